"""One check per kind of config number: counts, reals and flags, as a model file (config.json, GGUF metadata) or
a constructor gives them. Each refusal is a one-line ValueError naming the field, so that a wrong value never
reaches the math (a zero head count divided, a NaN epsilon normalised every activation to NaN)."""

from __future__ import annotations

import math
import numbers
from typing import Any

# Counts index tensors through 32-bit ints in the native kernels (and torch's int32 index paths): a count at or
# above 2^31 cannot be a model we run, only a damaged file.
MAX_COUNT = (1 << 31) - 1


def check_int(value: Any, field: str, minimum: int = 1, maximum: int = MAX_COUNT) -> int:
    """`value` when it is an int (not a bool) in [minimum, maximum]; else a ValueError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an integer, got {value!r} ({type(value).__name__})")
    if not minimum <= value <= maximum:
        raise ValueError(f"{field} must be an integer in [{minimum}, {maximum}], got {value}")
    return value


def to_int(value: Any, field: str, minimum: int = 1, maximum: int = MAX_COUNT) -> int:
    """A count as a file spells it: an integer, or an integral number (JSON's 1e6 parses as a float; numpy's
    integers come from GGUF arrays); strings, bools, lists, NaN and fractions are refused."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    return check_int(value, field, minimum, maximum)


def check_float(
    value: Any, field: str, minimum: float = -math.inf, maximum: float = math.inf, *, open_minimum: bool = True
) -> float:
    """`value` as a float when it is a finite real number (not a bool) above `minimum` (or at it, with
    open_minimum=False) and at most `maximum`; else a ValueError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    low_ok = value > minimum if open_minimum else value >= minimum
    if not math.isfinite(value) or not low_ok or value > maximum:
        low = f"({minimum}" if open_minimum else f"[{minimum}"
        raise ValueError(f"{field} must be a finite number in {low}, {maximum}], got {value}")
    return value


def check_bool(value: Any, field: str) -> bool:
    """`value` when it is true or false (a string "false" is truthy, so it is refused, not guessed)."""
    if not isinstance(value, bool):
        raise ValueError(f"{field} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def check_dict(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be an object (a dict of named values), got {value!r} ({type(value).__name__})")
    return value


def check_list(value: Any, field: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{field} must be a list, got {value!r} ({type(value).__name__})")
    return list(value)


def required(raw: dict[str, Any], key: str, where: str = "config.json") -> Any:
    """raw[key], or a ValueError saying the file lacks it (a null counts as missing)."""
    value = raw.get(key)
    if value is None:
        raise ValueError(f"{where} has no {key}; the file is incomplete: re-download it")
    return value


def optional(raw: dict[str, Any], key: str, default: Any) -> Any:
    """raw[key], or `default` when absent or null (HF writes null for "not set"); a 0 or "" stays, to be checked."""
    value = raw.get(key)
    return default if value is None else value
