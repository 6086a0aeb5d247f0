"""The packaged WikiText-2 test split: the exact file its README names, its licence beside it, and listed in
the package data so an installed wheel carries it."""

from __future__ import annotations

import fnmatch
import hashlib
import tomllib
from pathlib import Path

from leanlm.data import WIKITEXT2_TEST_SHA256, wikitext2_test_path

ROOT = Path(__file__).resolve().parents[2]


def test_the_packaged_file_is_wikitext2_raw_test_byte_for_byte():
    path = wikitext2_test_path()
    data = path.read_bytes()
    assert len(data) == 1_290_547 and hashlib.sha256(data).hexdigest() == WIKITEXT2_TEST_SHA256
    assert data.startswith(b" = Robert Boulter = \r\n")  # the first article; CRLF line ends as published
    readme = (path.parent / "README.md").read_text()
    assert WIKITEXT2_TEST_SHA256 in readme and "CC BY-SA 3.0" in readme
    assert "CC BY-SA 3.0" in (path.parent / "LICENSE").read_text()


def test_package_data_lists_every_file_beside_it():
    """setuptools only installs non-Python files that [tool.setuptools.package-data] matches."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data_dir = wikitext2_test_path().parent
    package_dir = ROOT / "leanlm" / "data"
    assert data_dir.parent == package_dir  # the worktree's copy, not another install's
    for file in data_dir.iterdir():
        relative = file.relative_to(package_dir).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in package_data["leanlm.data"]), relative
