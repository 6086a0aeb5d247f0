"""Byte counts as flags and options spell them: 800000000, '800MB', '1.5GB', '2GiB'."""

from __future__ import annotations

import re


def byte_count(text: str) -> int:
    """The CLI's reading of every byte-count flag (argparse names this function in its error: 'invalid
    byte_count'); 0 passes here, for flags where it means off: the config checks each field's own minimum."""
    return parse_bytes(text, "the byte count", minimum=0)


_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BYTE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_BYTE_COUNT = re.compile(r"(\d+(?:\.\d*)?)\s*([A-Za-z]*)")  # a number, then a unit (or none)


def parse_bytes(value: int | str, name: str = "size", minimum: int = 1) -> int:
    """A byte count from an int or a string: 800000000, '800MB', '1.5GB', '2GiB' (KB/MB/GB/TB are powers of
    1000, KiB/MiB/GiB/TiB of 1024). ValueError, naming `name`, for anything else or a count below `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} takes a byte count (an int, or a string like '1.5GB'), got {value!r}")
    if isinstance(value, str):
        match = _BYTE_COUNT.fullmatch(value.strip().replace("_", ""))
        if match is None or match.group(2).upper() not in _BYTE_UNITS:
            raise ValueError(f"{name} takes a byte count like 800000000, 800MB, 1.5GB or 2GiB; got {value!r}")
        number, unit = match.group(1), _BYTE_UNITS[match.group(2).upper()]
        value = int(float(number) * unit) if "." in number else int(number) * unit
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum} byte{'s' * (minimum != 1)}, got {value}")
    return value
