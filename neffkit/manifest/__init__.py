"""The manifest (schema 1): YAML → frozen dataclasses, strictly validated, defaults resolved once.

schema.py holds the values, fields.py the field readers, sections.py each section's reader and
parse.py the document. Imports no torch and nothing from neffkit.compile or neffkit.runtime.
"""

from neffkit.manifest.parse import load_manifest, parse_manifest
from neffkit.manifest.schema import Manifest

__all__ = ["Manifest", "load_manifest", "parse_manifest"]
