"""Whether only this user (or root) can have written a path: the owner and mode of it and of every directory
above it, the rule ssh's StrictModes applies to ~/.ssh. What LeanLM runs, loads or trusts from its caches and
from the peers' directory (compiled kernels, model markers, peer binaries and environments) must pass it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def untrusted_reason(path: str | Path) -> str | None:
    """None when `path` and each directory above it, both as written and with symlinks resolved, is owned by
    this user or root and writable by no one else; else what is wrong and how to fix it. A sticky directory
    (/tmp) may be writable by all: no one can rename or delete what another user made in it."""
    path = Path(os.path.abspath(path))
    me = os.getuid()
    seen = set()
    for chain in ((path, *path.parents), (path.resolve(), *path.resolve().parents)):
        for entry in chain:
            if entry in seen:
                continue
            seen.add(entry)
            try:
                st = os.lstat(entry)
            except OSError as e:
                return f"{entry} cannot be inspected ({e.strerror})"
            if st.st_uid not in (me, 0):
                return (
                    f"{entry} is owned by uid {st.st_uid}, not by this user (uid {me}) or root: whoever owns it "
                    f"can change what LeanLM would run or trust there; use a directory of your own"
                )
            sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & _OTHERS_WRITE and not sticky_dir:
                return (
                    f"{entry} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): they can change "
                    f"what LeanLM would run or trust there; `chmod go-w {entry}` if you trust its contents"
                )
    return None


def is_trusted(path: str | Path) -> bool:
    return untrusted_reason(path) is None
