"""pyproject.toml as setuptools reads it without deprecation banners: `make demo` and `make test`
install the package twice, and a `project.license` table printed setuptools' warning three times
per install."""

from __future__ import annotations

import re

from tests.support import REPO


def test_the_license_is_an_spdx_string_the_backend_reads():
    text = (REPO / "pyproject.toml").read_text()  # tomllib is Python 3.11's; 3.10 is supported
    assert re.search(r'^license = "Apache-2.0"$', text, re.M)
    # the first setuptools that reads an SPDX string
    assert re.search(r'^requires = \["setuptools>=77"\]$', text, re.M)
