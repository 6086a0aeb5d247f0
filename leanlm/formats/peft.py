"""PEFT's LoRA adapter format, read and written: adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...)
and adapter_model.safetensors (`base_model.model.<module>.lora_A.weight` [r, in], `.lora_B.weight` [out, r]).

Only what our runtime applies exactly is read: plain LoRA on linears (no DoRA, no biases, no embedding or head
adapters, no fully trained `modules_to_save`); anything else is refused by name rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from leanlm.config import ModelConfig
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.safetensors_header import check_safetensors_header
from leanlm.model.lora import LORA_TARGETS, lora_target_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."  # PeftModel wraps the CausalLM as base_model.model
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
MAX_CONFIG_BYTES = 1 << 20


class AdapterError(ValueError):
    """An adapter directory we cannot apply: the message says what is wrong and what to do."""


@dataclass(frozen=True)
class LoRAAdapter:
    """A LoRA adapter by its base model's module names (HF's), with the settings PEFT scales it by."""

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r]), float32
    r: int  # the default rank (a module's own is its A's rows: rank_pattern may differ)
    lora_alpha: float
    use_rslora: bool = False  # scale alpha / sqrt(r) (Kalajdzievski 2023) instead of alpha / r
    alpha_pattern: dict[str, float] = field(default_factory=dict)  # module name pattern -> its own alpha
    base_model_name_or_path: str | None = None
    target_modules: tuple[str, ...] = ()  # the module kinds it trains (q_proj, ...), as written to the config

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise AdapterError(f"LoRA rank r must be an integer >= 1, got {self.r!r}")
        if not isinstance(self.lora_alpha, (int, float)) or not math.isfinite(self.lora_alpha):
            raise AdapterError(f"lora_alpha must be a finite number, got {self.lora_alpha!r}")
        if not self.weights:
            raise AdapterError("the adapter has no LoRA weights")
        for name, (a, b) in self.weights.items():
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
                raise AdapterError(
                    f"{name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not [r, in] and [out, r]"
                )

    def rank(self, name: str) -> int:
        return int(self.weights[name][0].shape[0])

    @property
    def max_rank(self) -> int:
        return max(self.rank(n) for n in self.weights)

    def scaling(self, name: str) -> float:
        """The factor PEFT multiplies module `name`'s product by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        alpha = float(self.lora_alpha)
        for pattern, value in self.alpha_pattern.items():
            if _matches(pattern, name):
                alpha = float(value)
                break
        rank = self.rank(name)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def scaled(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """module -> (A, B, scaling): what LoRASlots.set_slot takes."""
        return {name: (a, b, self.scaling(name)) for name, (a, b) in self.weights.items()}


def _matches(pattern: str, name: str) -> bool:
    """PEFT's rank/alpha pattern rule: the key names the module or a dotted suffix of it (a regex allowed)."""
    try:
        return re.fullmatch(rf"(.*\.)?({pattern})", name) is not None
    except re.error:
        return name == pattern or name.endswith("." + pattern)


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{path} has no {CONFIG_FILE}: give the directory PEFT's save_pretrained wrote")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{file} is over {MAX_CONFIG_BYTES} bytes: not an adapter config")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise AdapterError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file} is not a JSON object")
    return config


def _check_config(config: dict, source: Path) -> None:
    """Refuse the PEFT settings our runtime would not apply exactly."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{source}: peft_type {peft_type} is not LoRA; only LoRA adapters are supported")
    if config.get("use_dora"):
        raise AdapterError(f"{source}: DoRA (use_dora) adapters are not supported; train a plain LoRA adapter")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{source}: bias={config['bias']!r} trains biases we do not apply; use bias='none'")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{source}: modules_to_save {config['modules_to_save']} trains whole copies of modules; only low-rank "
            "pairs on attention and MLP linears are supported"
        )
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{source}: fan_in_fan_out is for GPT-2's Conv1D weights; these are linear layers")
    targets = config.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    refused = sorted(n for n in names if isinstance(n, str) and n.split(".")[-1] in ("embed_tokens", "lm_head"))
    if refused:
        raise AdapterError(
            f"{source}: target_modules {refused} adapt embeddings or the head, which we do not apply; adapters may "
            f"target {', '.join(LORA_TARGETS)}"
        )


def read_adapter(path: str | Path, model_config: ModelConfig | None = None, max_rank: int | None = None) -> LoRAAdapter:
    """The adapter PEFT saved in directory `path`. With `model_config` (and `max_rank`), its module names, shapes and
    ranks are checked from the file's header before any tensor is read (AdapterError says what does not fit)."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"LoRA adapter {path} is not a directory (PEFT's save_pretrained writes one)")
    config = _read_config(path)
    _check_config(config, path)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        other = (
            " (adapter_model.bin is a pickle we do not load: re-save with safe_serialization)"
            if (path / "adapter_model.bin").is_file()
            else ""
        )
        raise AdapterError(f"{path} has no {WEIGHTS_FILE}{other}")
    try:
        header = check_safetensors_header(file)
    except ModelLoadError as e:
        raise AdapterError(str(e)) from None
    pairs = _pair_keys(header, path)
    if model_config is not None:
        shapes = {m: (header[k["A"]]["shape"], header[k["B"]]["shape"]) for m, k in pairs.items()}
        check_shapes(shapes, model_config, max_rank, path)
    with safe_open(str(file), framework="pt") as f:
        weights = {
            name: (f.get_tensor(keys["A"]).float(), f.get_tensor(keys["B"]).float()) for name, keys in pairs.items()
        }
    targets = config.get("target_modules") or sorted({n.split(".")[-1] for n in weights})
    return LoRAAdapter(
        weights=weights,
        r=int(config.get("r", max(int(header[k["A"]]["shape"][0]) for k in pairs.values()))),
        lora_alpha=float(config.get("lora_alpha", config.get("r", 8))),
        use_rslora=bool(config.get("use_rslora", False)),
        alpha_pattern={str(k): float(v) for k, v in (config.get("alpha_pattern") or {}).items()},
        base_model_name_or_path=config.get("base_model_name_or_path"),
        target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
    )


def _pair_keys(header: dict[str, dict], source: Path) -> dict[str, dict[str, str]]:
    """module -> {"A": key, "B": key} of the file's tensors; AdapterError for a tensor that is not half a LoRA pair."""
    pairs: dict[str, dict[str, str]] = {}
    for key in header:
        match = _KEY.match(key)
        if match is None:
            kind = "DoRA magnitudes" if "magnitude" in key else "embedding adapters" if "embedding" in key else "it"
            raise AdapterError(f"{source}: tensor {key!r} is not a lora_A / lora_B weight; we cannot apply {kind}")
        module = match["module"].removeprefix(KEY_PREFIX)
        pairs.setdefault(module, {})[match["side"]] = key
    for module, sides in pairs.items():
        if set(sides) != {"A", "B"}:
            raise AdapterError(f"{source}: {module} has lora_{''.join(sides)} but not both lora_A and lora_B")
    return pairs


def check_shapes(
    shapes: dict[str, tuple[list[int], list[int]]], model_config: ModelConfig, max_rank: int | None, source: Path | str
) -> None:
    """module -> (A's shape, B's shape): each module names a linear an adapter may change, with A [r, in] and
    B [out, r] of its features and r <= max_rank; AdapterError otherwise."""
    targets = lora_target_shapes(model_config)
    for module, (a_shape, b_shape) in shapes.items():
        if module not in targets:
            kind = module.split(".")[-1]
            why = (
                f"{kind} is not a linear we adapt (only {', '.join(LORA_TARGETS)} of dense layers)"
                if kind not in LORA_TARGETS
                else f"the model ({model_config.architecture}, {model_config.num_hidden_layers} layers) has no {module}"
            )
            raise AdapterError(f"{source}: the adapter changes {module}; {why}")
        out_features, in_features = targets[module]
        rank = a_shape[0] if a_shape else 0
        if list(a_shape) != [rank, in_features] or list(b_shape) != [out_features, rank] or rank < 1:
            raise AdapterError(
                f"{source}: {module} has lora_A {list(a_shape)} and lora_B {list(b_shape)}; this model needs "
                f"[r, {in_features}] and [{out_features}, r] (an adapter trained for another base model?)"
            )
        if max_rank is not None and rank > max_rank:
            raise AdapterError(f"{source}: {module} has rank {rank} > max_lora_rank {max_rank}; raise max_lora_rank")


def write_adapter(
    path: str | Path,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    r: int,
    lora_alpha: float,
    base_model_name_or_path: str | None,
    use_rslora: bool = False,
) -> Path:
    """Save module -> (A [r, in], B [out, r]) as PEFT's save_pretrained does, so PeftModel.from_pretrained and
    read_adapter load it. Returns the directory."""
    adapter = LoRAAdapter(dict(weights), r, lora_alpha, use_rslora, base_model_name_or_path=base_model_name_or_path)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in adapter.weights.items():
        tensors[f"{KEY_PREFIX}{name}.lora_A.weight"] = a.detach().float().contiguous().cpu()
        tensors[f"{KEY_PREFIX}{name}.lora_B.weight"] = b.detach().float().contiguous().cpu()
    targets = sorted({name.split(".")[-1] for name in adapter.weights})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": adapter.r,
        "lora_alpha": adapter.lora_alpha,
        "lora_dropout": 0.0,
        "use_rslora": adapter.use_rslora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    tmp = path / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / WEIGHTS_FILE)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path
