"""OLMo and OLMo 2 (dense)."""
