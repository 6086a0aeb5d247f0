"""Native kernel builds: cached by source hash, written atomically, one OpenMP runtime, private and trusted."""

import ctypes
import os
import shutil

import pytest

from leanlm.kernels import build, cpu_gemv

needs_kernels = pytest.mark.skipif(not cpu_gemv.is_available(), reason=f"{cpu_gemv.unavailable_reason()}")
needs_compiler = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")) or not (build.torch_lib_dir() / "libgomp.so.1").exists(),
    reason="needs a C compiler and torch's libgomp",
)


@needs_kernels
def test_build_is_cached_by_source_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))
    path = build.build_library(cpu_gemv._KERNEL.source)
    assert path.parent == tmp_path / "kernels" and path.exists()
    stamp = path.stat().st_mtime_ns
    assert build.build_library(cpu_gemv._KERNEL.source) == path and path.stat().st_mtime_ns == stamp
    assert os.listdir(path.parent) == [path.name]  # no temp files left behind


@needs_kernels
def test_a_broken_source_makes_the_kernel_unavailable_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))
    source = tmp_path / "broken.c"
    source.write_text("int f( {")
    kernel = build.NativeKernel(source, "f", [], None)
    assert not kernel.is_available()
    assert "compiling broken.c failed" in kernel.unavailable_reason


# ---------------------------------------------------------------------------------------------- trust


@pytest.fixture
def seven(tmp_path, monkeypatch):
    """A cached library built from a one-line source, in a fresh cache whose root does not exist yet."""
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "seven.c"
    source.write_text("int seven(void) { return 7; }\n")
    previous = os.umask(0o002)  # a common desktop umask: group-writable by default
    try:
        path = build.build_library(source)
    finally:
        os.umask(previous)
    return source, path


@needs_compiler
def test_cache_directories_are_private_and_the_library_trusted(seven):
    _, path = seven
    assert path.parent.stat().st_mode & 0o777 == 0o700 and path.parent.parent.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o022 == 0  # not group/world-writable despite the umask
    assert build.load_library(path).seven() == 7


@needs_compiler
def test_a_writable_cached_library_is_refused(seven):
    _, path = seven
    for mode in (0o666, 0o775):
        path.chmod(mode)
        with pytest.raises(RuntimeError, match="group- or world-writable"):
            build.load_library(path)


@needs_compiler
def test_a_library_of_another_user_is_refused(seven, monkeypatch):
    _, path = seven
    monkeypatch.setattr(build.os, "getuid", lambda: os.stat(path).st_uid + 4242)
    with pytest.raises(RuntimeError, match=r"owned by uid \d+, not by this user"):
        build.load_library(path)


@needs_compiler
def test_a_symlinked_library_is_refused(seven, tmp_path):
    _, path = seven
    elsewhere = tmp_path / "elsewhere.so"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    with pytest.raises(RuntimeError, match="not a regular file"):
        build.load_library(path)


@needs_compiler
@pytest.mark.parametrize("level", [1, 2])  # the cache root (LEANLM_CACHE), or the directory above it
def test_a_kernel_cache_below_a_directory_others_may_write_is_refused(seven, level):
    _, path = seven
    parent = path.parents[level]
    parent.chmod(0o777)  # another user could rename the cache away and put their own library in its place
    with pytest.raises(RuntimeError, match=f"refusing the kernel cache .*{parent}.* writable by other users"):
        build.load_library(path)


@needs_compiler
def test_an_old_group_writable_cache_directory_is_tightened(seven):
    _, path = seven
    path.parent.chmod(0o775)
    assert build.load_library(path).seven() == 7
    assert path.parent.stat().st_mode & 0o777 == 0o755


@needs_kernels
def test_a_refused_library_makes_the_kernel_fall_back(seven):
    source, path = seven
    kernel = build.NativeKernel(source, "seven", [], ctypes.c_int)
    assert kernel.is_available() and kernel.fn()() == 7
    path.chmod(0o666)  # e.g. another user could have replaced it
    refused = build.NativeKernel(source, "seven", [], ctypes.c_int)
    assert not refused.is_available() and "world-writable" in refused.unavailable_reason
