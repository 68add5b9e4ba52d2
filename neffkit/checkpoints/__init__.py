"""Checkpoints from other formats, turned into the HF directories a manifest's `model:` names."""
