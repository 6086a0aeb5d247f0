"""MLAConfig: multi-head latent attention (DeepSeek-V2, arXiv 2405.04434): keys and values are one low-rank latent
per token (kv_lora_rank wide, RMS-normed) that kv_b_proj expands per head, plus one rotary key slice every head
shares; queries optionally through their own low-rank bottleneck. The KV cache holds the latent and the rotary key:
kv_lora_rank + qk_rope_head_dim values per token and layer, instead of 2 * H * head_dim."""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.config.values import check_bool, check_int


@dataclass(frozen=True)
class MLAConfig:
    kv_lora_rank: int  # the latent's width: what the cache stores per token (with the rotary key)
    qk_nope_head_dim: int  # per head: the part of q and k without position (k's comes from the latent)
    qk_rope_head_dim: int  # per head: the rotary part (k's is one slice shared by every head)
    v_head_dim: int  # per head: the value's width (o_proj reads H * v_head_dim)
    q_lora_rank: int | None = None  # the queries' bottleneck (q_a_proj -> q_a_layernorm -> q_b_proj); None: q_proj
    rope_interleave: bool = True  # the rotary slices hold (x0, y0, x1, y1, ...) pairs (DeepSeek's layout)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_int(getattr(self, name), f"MLAConfig.{name}")
        if self.q_lora_rank is not None:
            check_int(self.q_lora_rank, "MLAConfig.q_lora_rank")
        check_bool(self.rope_interleave, "MLAConfig.rope_interleave")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")
        if self.latent_width % 2:
            raise ValueError(
                f"kv_lora_rank + qk_rope_head_dim ({self.latent_width}) must be even: the paged cache stores each "
                "token's latent as two halves"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values the cache stores per token and layer: the normed latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim
