"""IBM Granite (dense)."""
