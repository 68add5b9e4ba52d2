"""GPT-OSS: attention sinks, alternating sliding and full layers, biased routing and experts, a
clamped SwiGLU over interleaved gate/up (config.py reads it, model.py builds it)."""
