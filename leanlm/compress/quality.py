"""The check every compression run ends with: perplexity of the model before and after, on held-out text (the
packaged WikiText-2 test split, never the calibration text), so a checkpoint that a method left broken (2:4 + RTN on
a 135M model, MoEfication without retraining) is saved with its measured cost and a warning, not silently."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from leanlm.data import wikitext2_test_path

BROKEN_RATIO = 2.0  # perplexity more than doubled: the model's text is no longer usable as it was
NUM_WINDOWS, WINDOW_TOKENS = 2, 256  # 510 scored tokens: ~1 s a pass on the 135M model on 2 cores


@dataclass(frozen=True)
class QualityCheck:
    """Perplexity on the same held-out windows before and after compression."""

    ppl_before: float
    ppl_after: float
    num_tokens: int  # tokens scored in each pass

    @property
    def ratio(self) -> float:
        return self.ppl_after / self.ppl_before

    @property
    def is_broken(self) -> bool:
        return not math.isfinite(self.ppl_after) or self.ratio > BROKEN_RATIO

    def describe(self) -> str:
        line = (
            f"quality check: WikiText-2 perplexity {self.ppl_before:.2f} -> {self.ppl_after:.2f} "
            f"({self.ratio - 1:+.1%}) over {self.num_tokens} held-out tokens"
        )
        if self.is_broken:
            line += (
                f"\nWARNING: perplexity grew more than {BROKEN_RATIO:g}x: this checkpoint's text is likely garbage. "
                "Use a gentler recipe (more bits, a larger group, lower sparsity, GPTQ/SparseGPT instead of "
                "RTN/magnitude), or recover it by training (`leanlm train` / `leanlm distill`) before use"
            )
        return line


def held_out_windows(tokenizer, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[NUM_WINDOWS, WINDOW_TOKENS] token ids from the start of the packaged WikiText-2 test split; ValueError when
    the tokenizer cannot give them to this model."""
    text = wikitext2_test_path().read_text(encoding="utf-8")[:20_000]
    ids = tokenizer.encode(text, add_special_tokens=False)[: NUM_WINDOWS * WINDOW_TOKENS]
    if len(ids) < NUM_WINDOWS * WINDOW_TOKENS:
        raise ValueError(
            f"the held-out text gave {len(ids)} tokens; the quality check needs {NUM_WINDOWS * WINDOW_TOKENS}"
        )
    if max(ids) >= vocab_size:
        raise ValueError(
            f"the checkpoint's tokenizer makes token id {max(ids)} but its model has {vocab_size} embeddings: "
            "they do not belong together; save the model with its own tokenizer"
        )
    return torch.tensor(ids, device=device).view(NUM_WINDOWS, WINDOW_TOKENS)


@torch.no_grad()
def perplexity_of(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """exp(mean next-token NLL) of the whole-sequence forward (no KV cache) over windows [B, T]."""
    from leanlm.model.forward import causal_lm_loss

    return math.exp(float(causal_lm_loss(model, windows)))
