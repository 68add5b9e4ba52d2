"""Staging directories: a bundle (or an entry) is written beside its destination and renamed
into place only when complete, so a failed or killed build never leaves half a bundle.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from neffkit.contract.bundle import BUNDLE_JSON
from neffkit.contract.tempdirs import owned_temp_dir
from neffkit.errors import BundleError


@contextmanager
def staging_dir(dest: Path) -> Iterator[Path]:
    """A temp directory beside `dest`, renamed onto `dest` only if the block completes.

    On any exception (Ctrl-C included) the temp directory is removed and `dest` is untouched, so a
    failed build never leaves a half-written bundle.
    """
    dest = dest.resolve()
    if dest.exists() and not (dest / BUNDLE_JSON).exists():
        raise BundleError(
            f"{dest}: exists and is not a bundle; refusing to overwrite it",
            hint="choose another output directory with -o",
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = owned_temp_dir(f".{dest.name}.tmp-", dest.parent)
    try:
        yield tmp
        if dest.exists():
            old = Path(
                tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-old-", dir=dest.parent)
            )
            os.replace(dest, old / "bundle")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
