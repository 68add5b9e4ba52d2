"""The mixture-of-experts family over the Llama decoder: Mixtral and Qwen3-MoE (config.py reads
them, model.py builds them: the MoE block replaces the MLP on sparse layers, nothing else)."""
