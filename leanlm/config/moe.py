"""MoEConfig: the sparse MLP of a mixture-of-experts decoder (Mixtral, Qwen2-MoE, OLMoE, and the MoEs LeanLM builds
from dense models), read from and written to HF `config.json` keys; RoutingPolicy: the engine's capacity and
priority options for it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from leanlm.config.values import check_bool, check_dict, check_float, check_int, check_list, optional, required, to_int

# How a token's chosen experts are weighted:
#   softmax        - their softmax probabilities over all E (Qwen2-MoE / OLMoE with norm_topk_prob false)
#   softmax_renorm - those probabilities renormalised to sum to 1 over the k chosen (Mixtral; norm_topk_prob true)
#   ones           - every chosen expert counts 1: the experts partition one dense FFN (MoEfication), so top-k = E
#                    is the dense model exactly
#   sigmoid        - their sigmoid scores (DeepSeek-V3 with norm_topk_prob false)
#   sigmoid_renorm - those scores renormalised over the k chosen (DeepSeek-V3)
SCORINGS = ("softmax", "softmax_renorm", "ones", "sigmoid", "sigmoid_renorm")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int  # E
    top_k: int  # experts per token
    expert_intermediate_size: int  # each expert's FFN width
    scoring: str = "softmax_renorm"
    shared_expert_intermediate_size: int = 0  # an always-on expert (Qwen2-MoE, DeepSeek; PR-MoE's dense MLP); 0: none
    shared_expert_gate: bool = False  # sigmoid(x . w) scales the shared expert (Qwen2-MoE); False: added as is
    sparse_layers: tuple[int, ...] | None = None  # the layers with experts; None: every layer
    router_aux_loss_coef: float = 0.0  # Switch's load-balancing loss weight, for training
    # DeepSeek's group-limited routing: the E experts form num_groups groups, and a token picks its k experts only
    # from its topk_groups best groups (a group's score: its best expert's (softmax), or its best two's sum (sigmoid))
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # the chosen experts' weights are multiplied by it (DeepSeek)
    # a learned per-expert bias added to the scores for choosing experts only, not to their weights (DeepSeek-V3's
    # auxiliary-loss-free balancing): the router's e_score_correction_bias [E]
    score_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_intermediate_size"):
            check_int(getattr(self, name), f"MoEConfig.{name}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})")
        if not isinstance(self.scoring, str) or self.scoring not in SCORINGS:
            raise ValueError(f"MoEConfig.scoring {self.scoring!r} is not one of {SCORINGS}")
        check_int(self.shared_expert_intermediate_size, "MoEConfig.shared_expert_intermediate_size", minimum=0)
        check_bool(self.shared_expert_gate, "MoEConfig.shared_expert_gate")
        check_float(self.router_aux_loss_coef, "MoEConfig.router_aux_loss_coef", 0.0, open_minimum=False)
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("MoEConfig.shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")
        for i in self.sparse_layers or ():
            check_int(i, "MoEConfig.sparse_layers (layer indices)", minimum=0)
        check_int(self.num_groups, "MoEConfig.num_groups")
        check_int(self.topk_groups, "MoEConfig.topk_groups")
        check_float(self.routed_scaling_factor, "MoEConfig.routed_scaling_factor", 0.0)
        check_bool(self.score_bias, "MoEConfig.score_bias")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(
                f"MoEConfig: {self.num_experts} experts in {self.num_groups} groups, {self.topk_groups} of them per "
                "token: the groups must divide the experts, and a token cannot pick more groups than there are"
            )
        if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
            raise ValueError(f"MoEConfig: {self.topk_groups} groups hold fewer than top_k = {self.top_k} experts")

    @property
    def is_plain(self) -> bool:
        """Routing the native kernels compute: softmax scores, one group, no bias, weights unscaled."""
        return (
            self.scoring in ("softmax", "softmax_renorm", "ones")
            and self.num_groups == 1
            and not self.score_bias
            and self.routed_scaling_factor == 1.0
        )

    def is_sparse(self, layer_idx: int) -> bool:
        return self.sparse_layers is None or layer_idx in self.sparse_layers

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["sparse_layers"] = None if self.sparse_layers is None else list(self.sparse_layers)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MoEConfig:
        """The `leanlm_moe` block of a config.json written by to_dict (MoEs built from llama / qwen2 models)."""
        check_dict(raw, "leanlm_moe")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"leanlm_moe has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        layers = raw.get("sparse_layers")
        layers = None if layers is None else tuple(check_list(layers, "leanlm_moe.sparse_layers"))
        return cls(**{**raw, "sparse_layers": layers})


def moe_from_hf(model_type: str, cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """The MoEConfig of a config.json whose experts `model_type` (an Architecture's `moe` kind: mixtral, qwen2_moe,
    olmoe, qwen3_moe) describes, or of a dense family's one carrying `leanlm_moe`; None for a dense model."""
    if model_type == "deepseek":  # its architecture's read_config reads them
        return None
    if model_type not in ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe"):
        raw = cfg.get("leanlm_moe")
        return None if raw is None else MoEConfig.from_dict(raw)
    # transformers >= 5 writes Qwen3-MoE's count as num_local_experts; its checkpoints say num_experts
    experts_key = "num_local_experts" if model_type == "mixtral" or "num_experts" not in cfg else "num_experts"
    width_key = "moe_intermediate_size" if model_type in ("qwen2_moe", "qwen3_moe") else "intermediate_size"
    renorm = model_type == "mixtral" or check_bool(optional(cfg, "norm_topk_prob", False), "norm_topk_prob")
    common = dict(
        num_experts=to_int(required(cfg, experts_key), experts_key),
        top_k=to_int(required(cfg, "num_experts_per_tok"), "num_experts_per_tok"),
        expert_intermediate_size=to_int(required(cfg, width_key), width_key),
        scoring="softmax_renorm" if renorm else "softmax",  # MixtralTopKRouter always renormalises
        router_aux_loss_coef=check_float(
            optional(cfg, "router_aux_loss_coef", 0.0), "router_aux_loss_coef", 0.0, open_minimum=False
        ),
    )
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return MoEConfig(**common)
    step = to_int(optional(cfg, "decoder_sparse_step", 1), "decoder_sparse_step")
    dense = {
        to_int(i, "mlp_only_layers", minimum=0)
        for i in check_list(optional(cfg, "mlp_only_layers", []), "mlp_only_layers")
    }
    # every layer sparse is the usual case: then nothing walks the layers (a config may claim 2**31 - 1 of them)
    every = step == 1 and not dense
    sparse = () if every else tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = 0
    if model_type == "qwen2_moe":
        key = "shared_expert_intermediate_size"
        shared = to_int(optional(cfg, key, 0), key, minimum=0)
    return MoEConfig(
        **common,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=shared > 0,
        sparse_layers=None if every or len(sparse) == num_layers else sparse,
    )


def moe_to_hf(model_type: str, moe: MoEConfig, num_layers: int) -> dict[str, Any]:
    """The config.json keys HF's own class for `model_type` reads (`leanlm_moe` for llama / qwen2 MoEs)."""
    if model_type == "deepseek":  # its architecture's write_config writes them
        return {}
    if model_type == "mixtral":
        return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "intermediate_size": moe.expert_intermediate_size, "router_aux_loss_coef": moe.router_aux_loss_coef,
                "router_jitter_noise": 0.0, "output_router_logits": False}  # fmt: skip
    common = {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
              "norm_topk_prob": moe.scoring == "softmax_renorm", "router_aux_loss_coef": moe.router_aux_loss_coef,
              "output_router_logits": False}  # fmt: skip
    if model_type == "olmoe":
        return common | {"intermediate_size": moe.expert_intermediate_size}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        sparse = set(range(num_layers) if moe.sparse_layers is None else moe.sparse_layers)
        out = common | {
            "moe_intermediate_size": moe.expert_intermediate_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(num_layers) if i not in sparse],
        }
        if model_type == "qwen3_moe":  # transformers >= 5 reads num_local_experts
            return out | {"num_local_experts": moe.num_experts}
        return out | {"shared_expert_intermediate_size": moe.shared_expert_intermediate_size}
    return {"leanlm_moe": moe.to_dict()}


def check_hf_expressible(model_type: str, moe: MoEConfig) -> None:
    """ValueError when HF's class for `model_type` could not run `moe` as configured (it would load other numbers)."""
    wants = {
        "mixtral": dict(scoring=("softmax_renorm",), shared=False, gate=False, layers=False),
        "olmoe": dict(scoring=("softmax", "softmax_renorm"), shared=False, gate=False, layers=False),
        "qwen2_moe": dict(scoring=("softmax", "softmax_renorm"), shared=True, gate=True, layers=True),
        "qwen3_moe": dict(scoring=("softmax", "softmax_renorm"), shared=False, gate=False, layers=True),
    }.get(model_type)
    if wants is None:
        return
    shared = moe.shared_expert_intermediate_size > 0
    if (
        moe.scoring not in wants["scoring"]
        or (shared and not wants["shared"])
        or (shared and moe.shared_expert_gate != wants["gate"])
        or (model_type == "qwen2_moe" and not shared)
        or (moe.sparse_layers is not None and not wants["layers"])
    ):
        raise ValueError(
            f"a {model_type} model cannot express this MoE ({moe}); save it as llama or qwen2 with a leanlm_moe block"
        )


@dataclass(frozen=True)
class RoutingPolicy:
    """How the engine routes a step's tokens: expert capacity (Switch Transformer) and batch priority routing
    (V-MoE). Capacity per expert = ceil(capacity_factor * tokens * top_k / E) over the step's tokens; an
    assignment beyond it is dropped (the token keeps its residual stream and any shared expert) and counted."""

    capacity_factor: float | None = None  # None: no capacity limit, no token is dropped
    # False: capacity goes to first choices before second ones, in token order (Switch / GShard);
    # True: to first choices before second ones, most confident token first (V-MoE's BPR)
    batch_priority: bool = False

    def __post_init__(self) -> None:
        cf = self.capacity_factor
        if cf is not None and (not math.isfinite(cf) or cf <= 0):
            raise ValueError(f"moe capacity_factor must be a positive number or None, got {cf}")
        if self.batch_priority and cf is None:
            raise ValueError("batch priority routing orders tokens for a capacity; set a capacity_factor too")

    def capacity(self, num_tokens: int, top_k: int, num_experts: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * num_tokens * top_k / num_experts))
