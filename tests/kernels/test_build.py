"""Native kernel builds: cached by source hash, written atomically, one OpenMP runtime."""

import os

import pytest

from leanlm.kernels import build, cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.is_available(), reason=f"{cpu_gemv.unavailable_reason()}")


def test_build_is_cached_by_source_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))
    path = build.build_library(cpu_gemv._KERNEL.source)
    assert path.parent == tmp_path / "kernels" and path.exists()
    stamp = path.stat().st_mtime_ns
    assert build.build_library(cpu_gemv._KERNEL.source) == path and path.stat().st_mtime_ns == stamp
    assert os.listdir(path.parent) == [path.name]  # no temp files left behind


def test_a_broken_source_makes_the_kernel_unavailable_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))
    source = tmp_path / "broken.c"
    source.write_text("int f( {")
    kernel = build.NativeKernel(source, "f", [], None)
    assert not kernel.is_available()
    assert "compiling broken.c failed" in kernel.unavailable_reason
