"""neffkit: build LLM inference graphs ahead of time into a versioned bundle;
serve it without a compiler."""

__version__ = "0.1.0"
