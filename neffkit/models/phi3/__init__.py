"""Phi-3 and Phi-4 (dense)."""
