"""HF checkpoints → static-shape decoder graphs. Build side only; the runtime never imports this."""
