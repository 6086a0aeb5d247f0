"""LinearGroup: which linears of a decoder layer read the same input and which op produces it, declared per
architecture as data: what SmoothQuant and AWQ fold scales along and what GPTQ / SparseGPT observe together."""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.config import ModelConfig


@dataclass(frozen=True)
class LinearGroup:
    """Linears of a layer that read the same input, and the op producing that input: the structure that
    SmoothQuant and AWQ fold per-channel scales along (y = producer(x) / s feeds W * s), declared as data."""

    producer: str  # submodule whose output is the group's input: a norm, or a linear
    linears: tuple[str, ...]  # submodule names, relative to the layer
    # the block whose output AWQ scores the group's scales on, fed by the group's input (AutoAWQ's
    # module2inspect): attention for q/k/v, the MLP for gate/up; "" = the group's one linear itself
    block: str = ""
    can_fold: bool = True  # False when producer's output channels do not map 1:1 to the inputs (GQA v -> o)

    def __post_init__(self) -> None:
        if not self.block:
            if len(self.linears) != 1:
                raise ValueError(f"a group of several linears {self.linears} must name the block they feed")
            object.__setattr__(self, "block", self.linears[0])


def mlp_groups(prefix: str, producer: str, can_fold: bool = True) -> tuple[LinearGroup, ...]:
    """The two groups of the SwiGLU MLP at `prefix`: gate/up fed by `producer`, down fed by up."""
    return (
        LinearGroup(producer, (f"{prefix}.gate_proj", f"{prefix}.up_proj"), prefix, can_fold=can_fold),
        LinearGroup(f"{prefix}.up_proj", (f"{prefix}.down_proj",)),
    )


def layer_groups(config: ModelConfig, sparse: bool) -> tuple[LinearGroup, ...]:
    """A decoder layer's linear groups. In a sparse layer each expert is its own group (each sees only the tokens
    routed to it); the norm feeds the router and every expert, so no scale folds into it (can_fold False); the
    router is no linear of any group: it stays float."""
    # v_proj's output channels reach o_proj one-to-one only without grouped-query attention; OLMoE's norms over all
    # of q and k and the clamps stand between the input norm and the attention, so nothing folds there either (a
    # per-head q/k norm acts on q_proj's outputs, not on its inputs: the input norm still folds).
    attention = (
        latent_groups(config)
        if config.mla is not None
        else (
            LinearGroup(
                "input_layernorm",
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "self_attn",
                can_fold=config.qk_norm != "whole" and config.clip_qkv is None,
            ),  # fmt: skip
            LinearGroup(
                "self_attn.v_proj",
                ("self_attn.o_proj",),
                can_fold=config.num_attention_heads == config.num_key_value_heads and config.clip_qkv is None,
            ),
        )
    )
    mlp_norm = mlp_norm_name(config)
    if not sparse:
        return attention + mlp_groups("mlp", mlp_norm)
    experts = [f"mlp.experts.{e}" for e in range(config.moe.num_experts)]
    if config.moe.shared_expert_intermediate_size:
        experts.append("mlp.shared_expert")
    return attention + sum((mlp_groups(p, mlp_norm, can_fold=False) for p in experts), ())


def latent_groups(config: ModelConfig) -> tuple[LinearGroup, ...]:
    """MLA's groups: the input norm feeds the query (or its bottleneck) and the latent projection; the latent's and
    the query bottleneck's norms feed their expansions; the expanded values reach o_proj through the softmax mix of
    every head's own rows, which no per-channel scale survives (can_fold False)."""
    a = "self_attn."
    q_in = a + ("q_proj" if config.mla.q_lora_rank is None else "q_a_proj")
    groups = [
        LinearGroup("input_layernorm", (q_in, a + "kv_a_proj_with_mqa"), "self_attn"),
        LinearGroup(a + "kv_a_layernorm", (a + "kv_b_proj",)),
        LinearGroup(a + "kv_b_proj", (a + "o_proj",), can_fold=False),
    ]
    if config.mla.q_lora_rank is not None:
        groups.insert(1, LinearGroup(a + "q_a_layernorm", (a + "q_b_proj",)))
    return tuple(groups)


def mlp_norm_name(config: ModelConfig) -> str:
    """The norm whose output the MLP reads: Llama's post_attention_layernorm, or Gemma's pre_feedforward_layernorm
    (its post_attention_layernorm normalises the attention's output)."""
    return "pre_feedforward_layernorm" if config.arch.sandwich_norms else "post_attention_layernorm"
