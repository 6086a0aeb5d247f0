"""Where a model directory is written: never over the files a model or its data is read from, never over a
non-empty directory unless the caller says overwrite, and always into a temporary sibling renamed into place at
the end, so a failed or interrupted save leaves the old directory (or none), never a mix of two models."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputDirError(ValueError):
    """An output directory that must not be written (a ValueError: the CLI answers it in one line, exit 2)."""


def check_output_dir(
    out: str | Path,
    sources: Iterable[str | Path | None] = (),
    *,
    overwrite: bool = False,
    own_files: Collection[str] = (),
) -> Path:
    """`out` resolved, or OutputDirError when a model directory may not be written there: `out` is, is inside or
    holds one of `sources` (the model, data or other files the writer reads; with or without overwrite: replacing
    the directory would delete them), `out` is a file, `out` is a non-empty directory and `overwrite` is False, or
    a non-empty `out` holds the working or home directory (even with overwrite).
    Entries named in `own_files` (a training run's resumable state) do not make it non-empty. Sources that do not
    exist as paths (a bundled model name) are skipped: a Checkpoint's own `source` is the resolved file."""
    target = Path(out).expanduser().resolve()
    for source in sources:
        if source is None or not Path(source).expanduser().exists():
            continue
        src = Path(source).expanduser().resolve()
        if target == src or target.is_relative_to(src) or src.is_relative_to(target):
            where = "is" if target == src else "is inside" if target.is_relative_to(src) else "holds"
            raise OutputDirError(
                f"the output directory {out} {where} {source}, which this run reads; writing there would destroy "
                f"it: pick another output directory"
            )
    if target.exists() and not target.is_dir():
        raise OutputDirError(f"the output {out} is a file, not a directory; pick a directory path")
    entries = sorted(e.name for e in target.iterdir() if e.name not in own_files) if target.is_dir() else []
    if entries and overwrite:
        # replacing deletes everything there: never the directory the user works in, their home, or above them
        for place in (Path.cwd(), Path("~").expanduser()):
            if place.resolve().is_relative_to(target):
                raise OutputDirError(
                    f"the output directory {out} holds {place}; replacing it would delete that: give the model a "
                    f"directory of its own"
                )
    if entries and not overwrite:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise OutputDirError(
            f"the output directory {out} is not empty (it holds {shown}); pick another one, or replace it "
            f"with --overwrite (overwrite=True in Python)"
        )
    return target


@contextmanager
def staged_output_dir(
    out: str | Path,
    sources: Iterable[str | Path | None] = (),
    *,
    overwrite: bool = False,
    keep_files: Collection[str] = (),
) -> Iterator[Path]:
    """`with staged_output_dir(out, sources) as tmp:` write the model into `tmp`; when the block ends normally
    `tmp` becomes `out` (checked first by check_output_dir; entries of the old `out` named in `keep_files` move
    into the new one and do not count as content). On an exception `tmp` is removed and `out` is left as it was.

    `tmp` is a hidden sibling of `out` (same file system, so the final rename is atomic). An empty or missing
    `out` is replaced by one rename; a non-empty one (overwrite only) is first renamed aside, and put back if the
    second rename fails, then deleted: there is a moment with no `out`, never one with a mix."""
    target = check_output_dir(out, sources, overwrite=overwrite, own_files=keep_files)
    target.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir (not mkdtemp, which makes it 0700): the directory gets the permissions a plain mkdir gives
    staging = target.parent / f".{target.name}.partial-{secrets.token_hex(4)}"
    staging.mkdir()
    moved: list[str] = []
    try:
        yield staging
        check_output_dir(out, overwrite=overwrite, own_files=keep_files)  # again: it may have filled meanwhile
        for name in keep_files:  # renamed, not copied: a training state or a teacher cache can be gigabytes
            if (target / name).exists():
                os.rename(target / name, staging / name)
                moved.append(name)
        _replace_dir(staging, target)
    except BaseException:
        for name in moved:  # back where they were: a failed save loses nothing of the old directory
            os.rename(staging / name, target / name)
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace_dir(new: Path, target: Path) -> None:
    try:
        os.rename(new, target)  # POSIX replaces a missing or empty directory in one step
        return
    except OSError:
        if not target.is_dir() or not any(target.iterdir()):
            raise
    old = target.parent / f".{target.name}.old-{secrets.token_hex(4)}"
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
