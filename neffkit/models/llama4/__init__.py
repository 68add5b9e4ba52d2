"""Llama 4 (text): interleaved MoE layers, chunked local attention, NoPE layers."""
