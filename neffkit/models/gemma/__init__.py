"""Gemma 2 and Gemma 3 (text)."""
