"""Calibration text and the only layer x data loop: every method runs through `run_layers`.

For each decoder layer: observe what feeds each linear group (hooks), let each method edit the layer in
turn, then run the (already compressed) layer to make the next layer's inputs (GPTQ/AWQ's sequential
scheme). Attention runs through the engine's own paged backend, so calibration sees serving numerics.
"""

from __future__ import annotations

import bz2
import copy
import functools
import html
import importlib.util
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.compress.base import (
    NEEDS_HESSIAN,
    NEEDS_LAYER,
    NEEDS_PLAN,
    NEEDS_SEQUENCES,
    NEEDS_STATS,
    GroupInputs,
    LayerInputs,
    LinearReport,
    Method,
)
from leanlm.model.context import build_forward_context, forward_context
from leanlm.model.llama import LlamaAttention
from leanlm.model.mla import LatentAttention
from leanlm.model.paged_kv import PagedKVCache

_WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MAX_SAMPLE_ROWS = 4096  # input rows kept per linear group for AWQ's search and the error report
_BLOCK_SIZE = 16


# ------------------------------------------------------------------------------------------------ text


def default_calibration_file() -> Path:
    """Real Wikipedia articles shipped inside gensim's test data (never the evaluation text)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no calibration text: install gensim==4.4.0 --no-deps (it ships Wikipedia "
            "articles) or pass a text file with --calib"
        )
    return Path(list(spec.submodule_search_locations)[0]) / _WIKI_FILE


def strip_wiki_markup(xml: str) -> str:
    """Plain article text from a MediaWiki XML dump: the <text> bodies without templates, refs, tables,
    tags and link syntax; redirects are dropped."""
    articles = []
    for body in re.findall(r"<text[^>]*>(.*?)</text>", xml, flags=re.S):
        t = html.unescape(body)
        if t.lstrip().upper().startswith("#REDIRECT"):
            continue
        t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
        t = re.sub(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>", "", t, flags=re.S)
        for _ in range(3):  # nested templates and tables, innermost first
            t = re.sub(r"\{\{[^{}]*\}\}|\{\|[^{}]*?\|\}", "", t, flags=re.S)
        t = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", t)
        t = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", t)
        t = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", t)
        t = re.sub(r"<[^>]+>|'{2,}|\{\{|\}\}|\[\[|\]\]", "", t)  # tags, bold/italic, unmatched leftovers
        t = re.sub(r"^[=*#:;|!{}].*$", "", t, flags=re.M)  # headings, lists, table rows
        t = re.sub(r"\n{3,}", "\n\n", t).strip()
        if len(t) > 200:
            articles.append(t)
    return "\n\n".join(articles)


def read_calibration_text(path: str | Path | None = None) -> str:
    """A text file, or a (bz2) MediaWiki dump cleaned to plain text; the gensim articles by default."""
    path = Path(path) if path is not None else default_calibration_file()
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")
    with open(path, "rb") as f:
        is_bz2 = f.read(3) == b"BZh"
    raw = (bz2.open(path, "rt", encoding="utf-8") if is_bz2 else open(path, encoding="utf-8")).read()
    return strip_wiki_markup(raw) if "<mediawiki" in raw[:2000] else raw


def calibration_samples(token_ids: Sequence[int], num_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """`num_samples` windows of `seq_len` tokens at random (seeded) offsets of the tokenized text -> [S, T]."""
    if num_samples < 1 or seq_len < 2:
        raise ValueError("need num_samples >= 1 and seq_len >= 2")
    ids = torch.tensor(token_ids, dtype=torch.long)
    if len(ids) < seq_len:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than seq_len={seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len + 1, (num_samples,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


# ------------------------------------------------------------------------------------------ layer loop


class LayerRunner:
    """Runs one decoder layer over calibration hidden states [S, T, d], `batch` samples per forward, with a
    private KV cache and a prefill forward context (the engine's attention path)."""

    def __init__(self, model: nn.Module, seq_len: int, batch: int) -> None:
        cfg = model.config
        self.model, self.seq_len, self.batch = model, seq_len, batch
        param = model.model.norm.weight
        blocks_per_seq = -(-seq_len // _BLOCK_SIZE)
        # One layer's cache, reused by each layer in turn (a PagedKVCache view per layer, see _run).
        self.kv = PagedKVCache.allocate(
            1, batch * blocks_per_seq, cfg.cache_kv_heads, _BLOCK_SIZE, cfg.cache_head_dim, param.dtype, param.device
        ).kv  # [1, 2, N, Hkv, bs, D]
        self.block_ids = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        positions = torch.arange(seq_len, device=param.device)
        self.rope = model.rotary_emb(positions.repeat(batch), param.dtype)

    def __call__(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, T, d] -> layer outputs [S, T, d]."""
        return self._run(layer, lambda x, rope: layer(x, rope), hidden)

    def feed(self, layer: nn.Module, hidden: torch.Tensor) -> None:
        """Run the layer on hidden [S, T, d] for its hooks only: a hook raising StopForward ends that chunk's
        forward there (the rest of the layer is not needed)."""

        def fn(x, rope):
            try:
                layer(x, rope)
            except StopForward:
                pass

        self._run(layer, fn, hidden, keep=False)

    def run_module(self, layer: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One submodule of `layer` (its attention, MLP or a linear) on whole sequences x [S, T, K] -> [S, T, N].
        A module that owns a KV cache is attention and also takes the rotary tables."""
        if isinstance(module, (LlamaAttention, LatentAttention)):
            return self._run(layer, lambda flat, rope: module(flat, rope), x)
        return self._run(layer, lambda flat, rope: module(flat), x)

    def _run(self, layer: nn.Module, fn, hidden: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
        """fn(rows [n*T, K], rope) -> [n*T, N] over `batch` sequences of hidden [S, T, K] at a time; the
        outputs [S, T, N] when `keep`."""
        cache = PagedKVCache(self.kv, first_layer=layer.self_attn.layer_idx)
        outs = []
        for start in range(0, hidden.shape[0], self.batch):
            chunk = hidden[start : start + self.batch]
            n = chunk.shape[0]
            ctx = build_forward_context([self.seq_len] * n, [self.seq_len] * n, self.block_ids[:n], cache)
            rope = self.rope.first(n * self.seq_len)
            with forward_context(ctx):
                out = fn(chunk.reshape(-1, chunk.shape[-1]), rope)
            if keep:
                outs.append(out.view(n, self.seq_len, -1))
        return torch.cat(outs) if keep else None


class StopForward(Exception):
    """Raised by an observer hook once every observed group has seen the current chunk."""


class _InputObserver:
    """Forward pre-hook accumulating GroupInputs for one linear's input (all calibration tokens)."""

    def __init__(
        self, in_features: int, num_tokens: int, with_hessian: bool, device: torch.device, num_sequence_rows: int = 0
    ) -> None:
        self.absmax = torch.zeros(in_features, device=device)
        self.abs_sum = torch.zeros(in_features, device=device)
        self.sq_sum = torch.zeros(in_features, device=device)
        self.hessian = torch.zeros(in_features, in_features, device=device) if with_hessian else None
        self.keep_every = max(1, num_tokens // MAX_SAMPLE_ROWS)
        self.samples: list[torch.Tensor] = []
        self.num_sequence_rows = num_sequence_rows  # the first rows kept whole: S' sequences of T tokens
        self.sequence_rows: list[torch.Tensor] = []
        self.num_tokens = 0
        self.num_calls = 0  # chunks seen

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()  # [n * T, K]: whole windows
        if self.num_tokens < self.num_sequence_rows:
            self.sequence_rows.append(x[: self.num_sequence_rows - self.num_tokens])
        self.num_calls += 1
        self.absmax = torch.maximum(self.absmax, x.abs().amax(dim=0))
        self.abs_sum += x.abs().sum(dim=0)
        self.sq_sum += x.pow(2).sum(dim=0)
        if self.hessian is not None:
            self.hessian.addmm_(x.t(), x)
        offset = (-self.num_tokens) % self.keep_every
        self.samples.append(x[offset :: self.keep_every])
        self.num_tokens += x.shape[0]

    def result(self) -> GroupInputs:
        n = max(self.num_tokens, 1)
        hessian = None if self.hessian is None else self.hessian * (2.0 / n)
        samples = torch.cat(self.samples)[:MAX_SAMPLE_ROWS]
        sequences = torch.cat(self.sequence_rows) if self.sequence_rows else None  # [S' * T, K]
        return GroupInputs(self.absmax, self.abs_sum / n, self.sq_sum / n, samples, self.num_tokens, hessian, sequences)


def observe_inputs(
    layer: nn.Module, run: LayerRunner, hidden: torch.Tensor, needs: frozenset[str], groups: Sequence | None = None
) -> dict[str, GroupInputs]:
    """Run the layer on `hidden` [S, T, d] and return what fed each of `groups` (default: all of the layer's
    linear_groups), keyed by the group's first linear; `needs` holds the NEEDS_* of the method that reads
    them. Observing some groups only, each chunk's forward stops once they have all seen it."""
    groups = layer.linear_groups if groups is None else groups
    stop_early = len(groups) < len(layer.linear_groups)
    num_seqs, seq_len = min(hidden.shape[0], run.batch), hidden.shape[1]  # one runner batch kept whole
    keep_rows = num_seqs * seq_len if NEEDS_SEQUENCES in needs else 0
    observers, handles = {}, []

    def hook(obs: _InputObserver):
        def observe(module, args):
            obs(module, args)
            if stop_early and all(o.num_calls == obs.num_calls for o in observers.values()):
                raise StopForward

        return observe

    for group in groups:
        first = group.linears[0]
        linear = layer.get_submodule(first)
        obs = _InputObserver(
            linear.in_features, hidden.shape[0] * seq_len, NEEDS_HESSIAN in needs, hidden.device, keep_rows
        )
        observers[first] = obs
        handles.append(linear.register_forward_pre_hook(hook(obs)))
    try:
        run.feed(layer, hidden)
    finally:
        for h in handles:
            h.remove()
    inputs = {name: obs.result() for name, obs in observers.items()}
    if keep_rows:
        for fed in inputs.values():
            if fed.sequences.shape[0] != keep_rows:  # an expert sees only the rows routed to it: no whole sequences
                continue
            fed.sequences = fed.sequences.view(num_seqs, seq_len, -1)
            fed.run = functools.partial(run.run_module, layer)
    return inputs


def observe_head(model: nn.Module, hidden: torch.Tensor, with_hessian: bool) -> GroupInputs:
    """What feeds lm_head: the final norm of the last layer's outputs."""
    obs = _InputObserver(hidden.shape[-1], hidden.shape[0] * hidden.shape[1], with_hessian, hidden.device)
    for sample in hidden:
        obs(None, (model.model.norm(sample),))
    return obs.result()


@torch.no_grad()
def plan_pass(
    layers: nn.ModuleList, planners: list[Method], runner: LayerRunner, hidden: torch.Tensor, progress: bool
) -> None:
    """Run the uncompressed layers over the calibration hidden states [S, T, d] once, handing every planner
    each layer's group inputs (NEEDS_STATS) before any layer is compressed."""
    for idx, layer in enumerate(tqdm(layers, desc="planning layers", unit="layer", disable=not progress)):
        inputs = observe_inputs(layer, runner, hidden, frozenset({NEEDS_STATS}))
        for method in planners:
            method.plan_layer(f"model.layers.{idx}", layer, inputs)
        hidden = runner(layer, hidden)


def run_layers(
    model: nn.Module, methods: list[Method], samples: torch.Tensor | None, batch: int = 8, progress: bool = True
) -> list[LinearReport]:
    """Apply `methods` in order to every decoder layer (then the head), propagating compressed outputs.

    samples [S, T] token ids, or None for data-free methods (RTN, FP8).
    """
    for method in methods:  # before the embedding runs: a method may reorder it (channel permutation)
        method.begin(model)
    needs = set().union(*(m.needs for m in methods))
    if needs and samples is None:
        names = [type(m.config).__name__ for m in methods if m.needs]
        raise ValueError(f"{', '.join(names)} need calibration samples; pass token ids [num_samples, seq_len]")
    reports: list[LinearReport] = []
    hidden = runner = None
    if samples is not None:
        device = model.model.norm.weight.device
        hidden = model.model.embed(samples.to(device))  # [S, T, d]
        runner = LayerRunner(model, samples.shape[1], batch)
    layers = model.model.layers
    planners = [m for m in methods if NEEDS_PLAN in m.needs]
    if planners and hidden is not None:
        plan_pass(layers, planners, runner, hidden, progress)
    keeps_teacher = any(NEEDS_LAYER in m.needs for m in methods)
    for idx, layer in enumerate(tqdm(layers, desc="compressing layers", unit="layer", disable=not progress)):
        prefix = f"model.layers.{idx}"
        teacher = copy.deepcopy(layer) if keeps_teacher and hidden is not None else None
        for method in methods:
            if hidden is None:
                reports += method.apply_layer(layer, prefix, None)
                continue
            if NEEDS_LAYER in method.needs:
                groups = observe_inputs(layer, runner, hidden, method.needs) if NEEDS_STATS in method.needs else None
                reports += method.fit_layer(layer, prefix, LayerInputs(hidden, teacher, groups))
                continue
            # a sequential method sees each group's inputs through the groups it has already compressed
            for groups in [(g,) for g in layer.linear_groups] if method.is_sequential else [layer.linear_groups]:
                inputs = observe_inputs(layer, runner, hidden, method.needs, groups)
                reports += method.apply_layer(layer, prefix, inputs)
        if hidden is not None:
            hidden = runner(layer, hidden)
    for method in methods:
        inputs = None if hidden is None else observe_head(model, hidden, NEEDS_HESSIAN in method.needs)
        reports += method.apply_head(model, inputs)
    return reports
