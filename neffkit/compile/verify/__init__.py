"""`build --verify`: representative inputs laid out by the graph ABI (`inputs.py`) and each
compiled graph run against its eager reference, on the host or on XLA:CPU (`run.py`)."""
