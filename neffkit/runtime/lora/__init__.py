"""LoRA adapters: reading PEFT adapter directories into the bundle's slot layout."""
