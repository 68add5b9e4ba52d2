"""Cohere Command R (dense)."""
