"""The dense Llama family: Llama, Mistral, Qwen2, Qwen3 (config.py reads, model.py builds)."""
