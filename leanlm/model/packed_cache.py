"""A derived copy of a layer's tensors (a weight packed for a kernel), remade when any of them changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _state(t: torch.Tensor | None) -> tuple | None:
    """Data pointer and version counter (inference tensors have none; they cannot be edited in place outside
    inference mode anyway)."""
    if t is None:
        return None
    return (t.data_ptr(), None if t.is_inference() else t._version)


class PackedCache:
    """Holds `make(*tensors)` for the tensors it was made from.

    A new tensor object, a new `.data` and in-place edits that bump the version counter (any op under
    no_grad) are seen; an in-place edit through `.data` is not, so clear() after one. The sources' storages
    are held while the copy exists, so a freed address cannot come back as a "new" tensor that looks old.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._value: Any = None
        self._sources: tuple = ()
        self._storages: tuple = ()
        self._states: tuple = ()

    @property
    def value(self) -> Any:
        """The current copy, or None (nothing made yet, or cleared)."""
        return self._value

    def get(self, tensors: tuple[torch.Tensor | None, ...], make: Callable[..., Any]) -> Any:
        states = tuple(map(_state, tensors))
        current = len(tensors) == len(self._sources) and all(map(lambda a, b: a is b, tensors, self._sources))
        if not (current and states == self._states):
            self.clear()  # free the stale copy before making the new one
            self._value = make(*tensors)
            self._sources, self._states = tensors, states
            self._storages = tuple(None if t is None else t.untyped_storage() for t in tensors)
        return self._value
