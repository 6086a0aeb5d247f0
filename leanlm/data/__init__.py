"""Data files LeanLM ships inside the package, so an installed copy needs nothing outside it: the
WikiText-2 raw test split (`leanlm eval` and `leanlm bench` read it by default), its licence beside it."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# Byte for byte the `wikitext-2-raw-v1` test split; the SHA-256 is the one its README states.
WIKITEXT2_TEST_SHA256 = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"


def wikitext2_test_path() -> Path:
    """The WikiText-2 raw test file (1.3 MB, CC BY-SA 3.0 / GFDL; wikitext-2-raw/README.md says how to
    score it). A real path, since users pass it on as `--data`: setuptools installs the package as a
    directory (the native kernels' C sources are read the same way)."""
    resource = resources.files(__name__) / "wikitext-2-raw" / "wiki.test.raw"
    if not isinstance(resource, Path):
        raise FileNotFoundError(f"the packaged WikiText-2 file is not on the file system ({resource}); "
                                "install leanlm as a directory (pip install, not a zip)")
    return resource
