"""`neffkit inspect`: audit what a team ships. Summary, graph table, one graph in detail, hazard
findings, bundle diff (bundle.py), the manifest-only rules (manifest.py), as data (--json,
versioned schema) and as tables (render.py).
"""
