"""Where the build's trace and compile jobs run: a local process pool (`workers.py`) or Ray
tasks across machines (`cluster.py`), behind one pool interface the build calls."""
