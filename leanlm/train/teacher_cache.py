"""The teacher's top-k next-token distribution over the training windows, computed once and kept on disk, so a
distillation run pays for the teacher's forward once: not at every epoch, not again on resumption, and not again
for another student (or another loss weight) trained on the same text.

Each position keeps the k most likely tokens' log-probabilities at the distillation temperature and the
log-probability of everything else (the tail), so the k + 1 bins are a complete distribution and a KL divergence
over them is exact for what they keep. The cache is a directory: `meta.json` (what it was computed from) and a
file per training window (about 100 kB at k = 32 and 512 tokens), written whole (temporary file, then rename) the
first time a run reads that window: a run reads its windows in a shuffled order, and any coarser unit would make
the teacher run on windows no run reads.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.model.forward import hidden_states

CHUNK = 1024  # positions per head product: bounds the [n, V] float32 scores


@dataclass(frozen=True)
class TeacherTargets:
    """The cached teacher distribution of a micro-batch, for positions 0 .. T-2 (those with a next token)."""

    indices: torch.Tensor  # [B, T-1, k] long: the teacher's k most likely next tokens
    logprobs: torch.Tensor  # [B, T-1, k] float32: their log-probabilities at the temperature
    tail: torch.Tensor  # [B, T-1] float32: log of the probability of every other token
    hidden: torch.Tensor | None = None  # [B, T-1, hidden] float32: its final-normed hidden states, when cached


@torch.no_grad()
def top_k_distribution(
    model: nn.Module, input_ids: torch.Tensor, top_k: int, temperature: float, hidden: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, T] -> indices [B, T-1, k], log-probabilities [B, T-1, k] and tail [B, T-1] of the model's
    next-token distribution at `temperature`. `hidden`: the model's final-normed hidden states of input_ids
    [B, T, hidden], when the caller has computed them."""
    batch, length = input_ids.shape
    if hidden is None:
        hidden = hidden_states(model, input_ids)
    hidden = hidden[:, :-1].reshape(batch * (length - 1), -1)  # [N, hidden]
    parts = []
    for start in range(0, hidden.shape[0], CHUNK):
        scores = model.compute_logits(hidden[start : start + CHUNK])  # [n, V]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) / temperature
        top, index = scores.topk(top_k, dim=-1)  # [n, k]
        logprobs = top - torch.logsumexp(scores, dim=-1, keepdim=True)
        parts.append((index, logprobs, tail_logprob(logprobs)))
    index, logprobs, tail = (torch.cat(p) for p in zip(*parts, strict=True))
    return (
        index.view(batch, length - 1, top_k),
        logprobs.view(batch, length - 1, top_k),
        tail.view(batch, length - 1),
    )


def tail_logprob(logprobs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(logprobs))) over the last dim: the log-probability of the tokens not listed. Floored at
    log(1e-12) (top-k lists that hold all the mass in float32), which keeps its gradient finite."""
    return torch.log((-torch.expm1(torch.logsumexp(logprobs, dim=-1))).clamp_min(1e-12))


class TeacherCache:
    """`build()` computes the windows a run reads; `targets(rows)` reads a micro-batch's targets from memory.

    With `hidden_states` in its identity it also keeps the teacher's final-normed hidden states (float16, 2 bytes
    x hidden size per position: DistilBERT's cosine loss reads them). Such a cache also serves runs that do not
    need them, and goes on storing them for every window it adds.
    """

    def __init__(self, directory: str | Path, identity: dict) -> None:
        self.directory, self.identity = Path(directory), identity
        self._loaded: dict[int, tuple[torch.Tensor, ...]] = {}  # row -> its tensors
        meta = self.directory / "meta.json"
        if meta.is_file():
            saved = json.loads(meta.read_text())
            if _without_hidden(saved) != _without_hidden(identity):
                raise ValueError(
                    f"{self.directory} caches another teacher or text ({saved}); pass another --teacher-cache or "
                    "delete it"
                )
            if identity.get("hidden_states") and not saved.get("hidden_states"):
                raise ValueError(
                    f"{self.directory} was computed without the teacher's hidden states, which the cosine loss "
                    "needs; pass another --teacher-cache or delete it"
                )
            self.identity = saved

    @staticmethod
    def identity_of(
        teacher: str, data_windows: torch.Tensor, top_k: int, temperature: float, dtype: str, hidden: bool = False
    ) -> dict:
        digest = hashlib.sha256(data_windows.contiguous().numpy().tobytes()).hexdigest()
        identity = {
            "teacher": teacher,
            "top_k": top_k,
            "temperature": temperature,
            "dtype": dtype,
            "windows": list(data_windows.shape),
            "text_sha256": digest,
        }
        return {**identity, "hidden_states": True} if hidden else identity  # caches from before keep their meta

    def _path(self, row: int) -> Path:
        return self.directory / f"window_{row:07d}.pt"

    def missing(self, rows: set[int]) -> list[int]:
        """The windows among `rows` whose distribution is not on disk yet."""
        return sorted(r for r in rows if not self._path(r).is_file())

    def build(self, teacher: nn.Module, windows: torch.Tensor, rows: set[int], batch_size: int, progress=True) -> int:
        """Compute and write the distribution of every window in `rows` not cached yet (windows [N, T]: the
        training windows); returns how many windows the teacher ran on. `teacher` runs under the caller's
        autocast."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "meta.json").write_text(json.dumps(self.identity, indent=1))
        missing = self.missing(rows)
        device = teacher.model.norm.weight.device
        keep_hidden = bool(self.identity.get("hidden_states"))
        for start in tqdm(range(0, len(missing), batch_size), desc="teacher top-k", unit="batch", disable=not progress):
            chunk = missing[start : start + batch_size]
            ids = windows[chunk].to(device)
            hidden = hidden_states(teacher, ids)  # [B, T, hidden]
            index, logprobs, tail = (
                t.cpu()
                for t in top_k_distribution(
                    teacher, ids, self.identity["top_k"], self.identity["temperature"], hidden=hidden
                )
            )
            for i, row in enumerate(chunk):
                record = {  # cloned: a saved view would write its whole batch's storage
                    "indices": index[i].to(torch.int32).clone(),  # int32: vocabularies pass 65,536 (Qwen2.5)
                    "logprobs": logprobs[i].to(torch.float16).clone(),
                    "tail": tail[i].clone(),
                }
                if keep_hidden:
                    record["hidden"] = hidden[i, :-1].to(torch.float16).cpu().clone()  # positions with a target
                tmp = self._path(row).with_suffix(".tmp")
                torch.save(record, tmp)
                os.replace(tmp, self._path(row))
        return len(missing)

    def targets(self, rows: list[int], device: torch.device) -> TeacherTargets:
        """The cached distribution of training windows `rows` (built before), on `device`."""
        for row in rows:
            if row not in self._loaded:
                if not self._path(row).is_file():
                    raise RuntimeError(f"{self._path(row)} is missing: build the cache for the run's windows first")
                record = torch.load(self._path(row), weights_only=True)
                # widened once here: CPU autocast refuses to stack float16
                parts = (record["indices"].long(), record["logprobs"].float(), record["tail"])
                # hidden states stay float16 in memory (half of a run's cache) and widen per micro-batch
                self._loaded[row] = parts + ((record["hidden"],) if "hidden" in record else ())
        columns = list(zip(*(self._loaded[r] for r in rows)))
        if len(columns) == 4:
            columns[3] = [h.float() for h in columns[3]]
        return TeacherTargets(*(torch.stack(parts).to(device) for parts in columns))


def _without_hidden(identity: dict) -> dict:
    return {k: v for k, v in identity.items() if k != "hidden_states"}
