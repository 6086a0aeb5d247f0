"""Architecture: what one decoder family is, declared as knobs the shared decoder, the loaders, `estimate`, the
compression loop and the sharders read. A family that differs from Llama only in knobs is a few lines of data; code
(`read_config`, `write_config`, name maps) only for what is genuinely its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from leanlm.config.model import ModelConfig

QK_NORMS = ("", "whole", "head")  # none; one RMSNorm over every head's q (k) at once (OLMoE); one per head (Qwen3)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP gate's activation
# how config.json spells the experts: "" dense (or a leanlm_moe block); "deepseek": the architecture's read_config
MOE_KINDS = ("", "mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek")

# state dict (file names) -> state dict (model names), or back; config gives the shapes to split by
Field = Callable[[str], Any]  # GGUF metadata key -> value, or None when absent
NameMap = Callable[["ModelConfig", "dict[str, torch.Tensor]"], "dict[str, torch.Tensor]"]


@dataclass(frozen=True)
class Architecture:
    """One HF `model_type` and everything that makes it differ from a plain Llama block."""

    model_type: str  # HF config.json's model_type: ModelConfig.architecture
    hf_class: str  # the class config.json's `architectures` names, which HF loaders build
    gguf_name: str = ""  # llama.cpp's general.architecture for it; "": no GGUF files
    # the block
    qkv_bias: bool = False  # bias on q/k/v_proj when config.json does not say (Qwen2)
    qk_norm: str = ""  # one of QK_NORMS: an RMSNorm over q and k after projection, before rotary
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma stores weight - 1
    sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and after the MLP too, before each residual add
    scales_embeddings: bool = False  # embeddings times sqrt(hidden_size), rounded to the compute dtype (Gemma)
    default_act: str = "silu"  # the gate activation when config.json does not say
    moe: str = ""  # one of MOE_KINDS: which config.json keys describe its experts
    window_every_layer: bool = False  # config.json's sliding_window applies to every layer (Mistral, Phi-3)
    # the files
    gguf_permutes_qk: bool = False  # llama.cpp's converter stored q/k rows for its interleaved rotary (llama)
    gguf_norm_offset: float = 0.0  # llama.cpp stores norm weights with norm_offset folded in (Gemma: +1)
    # GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N."), beyond the Llama ones
    gguf_layer_names: dict[str, str] = field(default_factory=dict)
    # GGUF tensors (name endings) that repeat what others hold (DeepSeek's attn_k_b / attn_v_b halves of attn_kv_b)
    gguf_skipped: tuple[str, ...] = ()
    # config.json -> extra ModelConfig fields (its own knobs), and back; None: Llama's keys say everything
    read_config: Callable[[dict[str, Any], int], dict[str, Any]] | None = None
    write_config: Callable[[ModelConfig], dict[str, Any]] | None = None
    # GGUF metadata -> extra ModelConfig fields: (field, general.architecture, layers, head_dim, tensor) -> fields,
    # where tensor(name) is a small metadata-like tensor's values (Phi-3's rope factors), or None
    read_gguf: Callable[[Field, str, int, int, Callable], dict[str, Any]] | None = None
    # tensors that files hold fused and the model holds apart (Phi-3's qkv_proj): split on read, fused on write
    to_model_names: NameMap | None = None
    to_file_names: NameMap | None = None

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("qk_norm", self.qk_norm, QK_NORMS),
            ("default_act", self.default_act, HIDDEN_ACTS),
            ("moe", self.moe, MOE_KINDS),
        ):
            if value not in allowed:
                raise ValueError(f"Architecture {self.model_type}: {name} {value!r} is not one of {allowed}")

    @property
    def is_llama_block(self) -> bool:
        """The block the native decode loop runs: pre-norms only, plain RMSNorm weights, SiLU gate, no q/k norm."""
        return not (self.qk_norm or self.norm_offset or self.sandwich_norms or self.scales_embeddings)
