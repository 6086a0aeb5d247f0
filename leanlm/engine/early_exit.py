"""CALM's per-token early exit at decode (Schuster et al. 2022, "Confident Adaptive Language Modeling").

A decode step runs the layers span by span. At each configured exit (after K layers) it reads the exit's
confidence in its next token (leanlm.model.exit_head: the top probability, the top-2 gap, or the saturation of
the hidden state over layer K). When every token of the step reaches the exit's threshold, their next tokens come
from the exit's logits and layers K.. are skipped. The skipped layers still need these tokens' K/V, because later
tokens attend to them there: CALM's state propagation fills them from the hidden state at K, through each skipped
layer's own input norm, K/V projections and rotary embedding (about 6% of a layer's weights).

A step exits only when all of its tokens may. With one request, that is CALM's per-token decision; with more, the
whole batch must be confident, so the share of exiting steps falls with the batch size, as with activation
sparsity. Prompts (and any step with a prompt chunk) always run every layer.

Each span runs on the native decode loop when the model has one (the span's layers, its exit's norm), otherwise on
the PyTorch layers; both leave the residual stream the next span starts from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from leanlm.config import EarlyExitConfig
from leanlm.model.context import ForwardContext
from leanlm.model.exit_head import saturation, softmax_max, top2_gap
from leanlm.model.llama import LlamaForCausalLM


@dataclass
class EarlyExitStats:
    """Totals since the engine started."""

    num_steps: int = 0  # decode steps that ran through the exits
    num_tokens: int = 0  # tokens those steps decoded
    exited: dict[int, int] = field(default_factory=dict)  # layer count K -> tokens that left there
    layers_run: int = 0  # decoder layers run, summed over those tokens

    @property
    def exit_rate(self) -> float:
        return sum(self.exited.values()) / self.num_tokens if self.num_tokens else 0.0

    @property
    def mean_layers(self) -> float:
        """Layers run per decoded token (0 before any step)."""
        return self.layers_run / self.num_tokens if self.num_tokens else 0.0


@dataclass(frozen=True)
class _Span:
    """Some layers of the model, ending after `end` layers, and the exit threshold checked there (None: none)."""

    model: LlamaForCausalLM  # a view sharing the model's modules (LlamaForCausalLM.layer_span)
    end: int
    threshold: float | None


class EarlyExit:
    """The decode forward with CALM's exits: `forward` replaces the model's forward on all-decode steps."""

    def __init__(self, model: LlamaForCausalLM, config: EarlyExitConfig) -> None:
        num_layers = model.config.num_hidden_layers
        for k, _ in config.exits:
            if k >= num_layers:
                raise ValueError(
                    f"an early exit after {k} layers needs a model of more layers; this one has {num_layers}"
                )
        self.model, self.config = model, config
        self.spans: list[_Span] = []
        start = 0
        for k, threshold in config.exits:
            # saturation compares the stream before and after layer K: a span must end at K - 1
            if config.measure == "saturation" and k - 1 > start:
                self.spans.append(_Span(model.layer_span(start, k - 1), k - 1, None))
                start = k - 1
            self.spans.append(_Span(model.layer_span(start, k), k, threshold))
            start = k
        self.spans.append(_Span(model.layer_span(start, num_layers), num_layers, None))
        self._stats = EarlyExitStats(exited={k: 0 for k, _ in config.exits})

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One all-decode step (inside `ctx`'s forward context): (hidden [T, hidden] the head reads, logits
        [T, V] when a step exited, else None: the caller computes them from the final hidden as usual)."""
        if not ctx.is_all_decode:
            raise ValueError("the early exit runs decode steps only (one new token per request)")
        x = self.model.model.embed(input_ids)  # [T, hidden]
        self._stats.num_steps += 1
        self._stats.num_tokens += x.shape[0]
        before = x
        for span in self.spans:
            if span.threshold is not None and self.config.measure == "saturation":
                before = x.clone()  # the native loop overwrites x with the stream after the span
            x, hidden = _run_span(span.model, x, positions, ctx)
            if span.threshold is None:
                continue
            if span.model.head_adapter is not None:
                hidden = span.model.head_adapter(hidden)
            logits = span.model.lm_head(hidden)  # [T, V]
            if bool((self._confidence(logits, before, x) >= span.threshold).all()):
                self._propagate(x, span.end, positions)
                self._stats.exited[span.end] += x.shape[0]
                self._stats.layers_run += span.end * x.shape[0]
                return hidden, logits
        self._stats.layers_run += self.model.config.num_hidden_layers * x.shape[0]
        return hidden, None

    def _confidence(self, logits: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """[T] confidence of each token at an exit: logits [T, V], the residual stream before and after its
        layer [T, hidden] (saturation)."""
        if self.config.measure == "softmax":
            return softmax_max(logits)
        if self.config.measure == "gap":
            return top2_gap(logits)
        return saturation(before, after)

    def _propagate(self, x: torch.Tensor, first_skipped: int, positions: torch.Tensor) -> None:
        """K/V of the step's tokens for every skipped layer, from the residual stream x [T, hidden] where they
        left (CALM's state propagation)."""
        model = self.model
        rope = model.rotary_emb(positions, x.dtype)
        for layer in model.model.layers[first_skipped:]:
            layer.self_attn.write_kv(layer.input_layernorm(x), rope)

    def stats(self) -> EarlyExitStats:
        s = self._stats
        return EarlyExitStats(s.num_steps, s.num_tokens, dict(s.exited), s.layers_run)


def _run_span(
    span: LlamaForCausalLM, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual stream x [T, hidden] through the span's layers -> (the stream after them, it normed by the
    span's norm). The native loop takes x and overwrites it; the PyTorch path leaves it alone."""
    if span.allow_native_decode:
        hidden = span.native_decode_plan().run(x, positions, ctx)
        if hidden is not None:
            return x, hidden
    rope = span.rotary_emb(positions, x.dtype)
    for layer in span.model.layers:
        x = layer(x, rope)
    return x, span.model.norm(x)
