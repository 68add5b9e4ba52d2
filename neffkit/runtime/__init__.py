"""The serving side: open a bundle, run its graphs. Imports nothing from neffkit.compile or
neffkit.models, and never imports torch._dynamo or torch._inductor (a test enforces this)."""
