"""The on-disk contract between `neffkit build` and everything that reads a bundle: bundle.json's
records (records.py, codec.py), reading and verifying a bundle (bundle.py, read.py), packs
(pack.py), staging directories (staging.py), tensor files, the NEFF header, and the graph ABI
(abi.py). Imports neither the build nor the runtime: both depend on it.
"""
