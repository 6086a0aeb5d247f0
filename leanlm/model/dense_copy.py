"""The fallback of last resort: where no native kernel runs a layer's format (no AVX2, an ARM CPU, a level capped to
`none`), keep one dequantized copy of its weight instead of dequantizing every weight on every step.

The copies share one process-wide budget (`LEANLM_DENSE_COPY_BYTES`, default half of the memory available when the
first copy is made): a layer beyond it dequantizes per call as before. The first copy logs one warning that says
why and what it costs, so a user who sees the memory grow knows the cause.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import torch

from leanlm.model.packed_cache import PackedCache

logger = logging.getLogger(__name__)
ENV = "LEANLM_DENSE_COPY_BYTES"


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class DenseCopyBudget:
    """Bytes the dense copies may hold together, and what they hold now (a copy gives its bytes back when freed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._limit: int | None = None
        self.held = 0
        self._warned = False

    def limit(self) -> int:
        if self._limit is None:
            raw = os.environ.get(ENV, "").strip()
            if raw:
                from leanlm.config.byte_count import parse_bytes

                self._limit = parse_bytes(raw, ENV, minimum=0)
            else:
                self._limit = _available_bytes() // 2
        return self._limit

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.held + nbytes > self.limit():
                return False
            self.held += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    def warn_once(self, what: str, nbytes: int) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        from leanlm.kernels import isa

        logger.warning(
            "no native kernel runs %s here (%s): keeping dequantized copies of such weights instead of "
            "dequantizing them on every step (%.1f MiB for the first; up to %.0f MiB in all, %s)",
            what,
            isa.describe(),
            nbytes / 2**20,
            self.limit() / 2**20,
            ENV,
        )


BUDGET = DenseCopyBudget()


class DenseCopy:
    """One layer's dequantized weight in one dtype, remade when the layer's tensors change (PackedCache)."""

    def __init__(self) -> None:
        self._cache = PackedCache()
        self._refused: tuple | None = None  # (dtype, sources) the budget refused: not asked again for them

    def get(self, tensors: tuple, dtype: torch.dtype, make, what: str) -> torch.Tensor | None:
        """make() as `dtype` [N, K], kept while `tensors` stay the same; None where the budget has no room."""
        value = self._cache.value
        if value is not None and value.dtype is not dtype:
            self._cache.clear()
        if self._refused is not None and self._refused == (dtype, tuple(map(id, tensors))):
            return None

        def build(*_sources):
            w = make().to(dtype).contiguous()
            nbytes = w.numel() * w.element_size()
            if not BUDGET.take(nbytes):
                return None
            weakref.finalize(w, BUDGET.give_back, nbytes)
            BUDGET.warn_once(what, nbytes)
            return w

        w = self._cache.get(tensors, build)
        if w is None:
            self._cache.clear()
            self._refused = (dtype, tuple(map(id, tensors)))
        return w
