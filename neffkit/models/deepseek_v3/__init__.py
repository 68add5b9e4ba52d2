"""DeepSeek-V3: multi-head latent attention over a latent KV cache, sigmoid group-limited routing
with a selection bias, shared experts (config.py reads it, model.py builds it)."""
