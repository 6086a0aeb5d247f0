"""RopeScaling: how a model stretches rotary position embeddings past the context it was pretrained on: 'linear'
(positions divided), 'llama3' (Llama 3.1's frequency-dependent division), 'longrope' (Phi-3's per-frequency factors,
LongRoPE, Ding et al. 2024), 'yarn' (Peng et al. 2023; DeepSeek-V2/V3, Qwen), read from config.json's rope_scaling /
rope_parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from leanlm.config.values import check_float, check_list, optional, required, to_int

ROPE_TYPES = ("llama3", "linear", "longrope", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # one of ROPE_TYPES
    factor: float  # llama3 / linear: the division of low frequencies (positions); longrope: context / original
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # the context the model was pretrained on
    # longrope: one divisor per frequency (D_rot / 2 of them) for positions below the original context, and past it
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # longrope / yarn: cos and sin are multiplied by it; None: the method's own (LongRoPE's sqrt(1 + ln(factor) /
    # ln(original context)); YaRN's 0.1 ln(factor) + 1, or its mscale / mscale_all_dim ratio)
    attention_factor: float | None = None
    beta_fast: float = 32.0  # yarn: rotations at which frequencies stop being interpolated ...
    beta_slow: float = 1.0  # ... and below which they are fully interpolated
    mscale: float = 0.0  # yarn (DeepSeek): the attention factor's numerator scale; 0: unset
    mscale_all_dim: float = 0.0  # yarn (DeepSeek): its denominator, and the softmax scale's mscale squared; 0: unset
    truncate: bool = True  # yarn: the correction range rounded to whole dimensions

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; use one of {ROPE_TYPES}")
        check_float(self.factor, "rope_scaling factor", 0.0)
        check_float(self.low_freq_factor, "rope_scaling low_freq_factor", 0.0)
        check_float(self.high_freq_factor, "rope_scaling high_freq_factor", 0.0)
        to_int(self.original_max_position_embeddings, "rope_scaling original_max_position_embeddings")
        # llama3's smoothing divides by their difference
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope_scaling high_freq_factor ({self.high_freq_factor}) must be above low_freq_factor "
                f"({self.low_freq_factor})"
            )
        if self.rope_type == "longrope":
            if not self.short_factor or len(self.short_factor) != len(self.long_factor):
                raise ValueError("longrope rope_scaling needs short_factor and long_factor lists of one length")
            for f in self.short_factor + self.long_factor:
                check_float(f, "rope_scaling short_factor / long_factor", 0.0)
        if self.attention_factor is not None:
            check_float(self.attention_factor, "rope_scaling attention_factor", 0.0)

    @property
    def magnitude(self) -> float:
        """What cos and sin are multiplied by (longrope's and yarn's attention factor; 1 for the others)."""
        if self.rope_type not in ("longrope", "yarn"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.rope_type == "yarn":
            if self.mscale and self.mscale_all_dim:
                return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
            return yarn_mscale(self.factor)
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))

    @property
    def softmax_scale(self) -> float:
        """What DeepSeek's attention multiplies its 1/sqrt(d) by under yarn: mscale(factor, mscale_all_dim)^2."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def to_hf(self) -> dict[str, Any]:
        """The rope_scaling object of config.json."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out |= {"low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor}
        if self.rope_type == "longrope":
            out |= {"short_factor": list(self.short_factor), "long_factor": list(self.long_factor)}
        if self.rope_type == "yarn":
            out |= {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate}
            out |= {k: getattr(self, k) for k in ("mscale", "mscale_all_dim") if getattr(self, k)}
        if self.attention_factor is not None:
            out["attention_factor"] = self.attention_factor
        return out | {"original_max_position_embeddings": self.original_max_position_embeddings}


def hf_rope_scaling(raw: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling | None:
    """config.json's rope_scaling (or rope_parameters) object; None for default rotary. `cfg` is the whole config:
    Phi-3 keeps original_max_position_embeddings there, and its factor is the ratio of the two contexts."""
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type in (None, "default"):
        return None
    if not isinstance(rope_type, str):
        raise ValueError(f"rope_scaling rope_type must be a string, got {rope_type!r}")
    rope_type = "longrope" if rope_type in ("su", "longrope") else rope_type  # Phi-3's first configs said "su"
    original = optional(
        raw, "original_max_position_embeddings", optional(cfg, "original_max_position_embeddings", 8192)
    )
    original = to_int(original, "rope_scaling original_max_position_embeddings")
    if rope_type == "longrope":
        context = to_int(optional(cfg, "max_position_embeddings", original), "max_position_embeddings")
        attention = raw.get("attention_factor")
        return RopeScaling(
            rope_type="longrope",
            factor=check_float(optional(raw, "factor", context / original), "rope_scaling factor", 0.0),
            original_max_position_embeddings=original,
            short_factor=tuple(check_list(required(raw, "short_factor", "rope_scaling"), "short_factor")),
            long_factor=tuple(check_list(required(raw, "long_factor", "rope_scaling"), "long_factor")),
            attention_factor=None if attention is None else check_float(attention, "attention_factor", 0.0),
        )
    if rope_type == "yarn":
        return _yarn(raw, original)
    return RopeScaling(
        rope_type=rope_type,
        factor=check_float(required(raw, "factor", "rope_scaling"), "rope_scaling factor", 0.0),
        low_freq_factor=check_float(optional(raw, "low_freq_factor", 1.0), "rope_scaling low_freq_factor", 0.0),
        high_freq_factor=check_float(optional(raw, "high_freq_factor", 4.0), "rope_scaling high_freq_factor", 0.0),
        original_max_position_embeddings=original,
    )


def _yarn(raw: dict[str, Any], original: int) -> RopeScaling:
    def number(key: str, default: float) -> float:
        return check_float(optional(raw, key, default), f"rope_scaling {key}", 0.0, open_minimum=False)

    attention = raw.get("attention_factor")
    return RopeScaling(
        rope_type="yarn",
        factor=check_float(required(raw, "factor", "rope_scaling"), "rope_scaling factor", 0.0),
        original_max_position_embeddings=original,
        attention_factor=None if attention is None else check_float(attention, "attention_factor", 0.0),
        beta_fast=number("beta_fast", 32.0) or 32.0,
        beta_slow=number("beta_slow", 1.0) or 1.0,
        mscale=number("mscale", 0.0),
        mscale_all_dim=number("mscale_all_dim", 0.0),
        truncate=bool(optional(raw, "truncate", True)),
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's blend [D/2]: frequencies that turn more than beta_fast times over the original context keep their value,
    those that turn fewer than beta_slow times are divided by `factor`, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return (
            dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=inv_freq.dtype) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency left as it is
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep
