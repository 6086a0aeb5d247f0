"""Hugging Face model directories, read and written: `config.json` + `model.safetensors` (or shards listed in the
index). Tensor names are HF's (MoE files' mapped by moe_names.py); a tied model has no `lm_head.weight`. Every
problem with the files becomes a ModelLoadError that names the file and says what to do."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from leanlm.config import ModelConfig
from leanlm.formats.moe_names import to_file_names, to_model_names
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.safetensors_header import check_safetensors_header
from leanlm.loading.shapes import check_held_experts

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_hf_dir(path: Path) -> bool:
    """True for a directory holding an HF `config.json`."""
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_config(path: Path, num_layers_held: int | None = None) -> ModelConfig:
    """The ModelConfig of `path`/config.json; ModelLoadError naming the key of any value of the wrong kind or range.
    With `num_layers_held` (the layers the weight files hold), a layer count that differs is refused before the
    config is built, since building it walks its layers."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{path} has no config.json; a Hugging Face model directory needs config.json next "
            "to its *.safetensors files"
        )
    try:
        raw = json.loads(config_path.read_text())
        claimed = raw.get("num_hidden_layers") if isinstance(raw, dict) else None
        # fewer layers than the tensors hold is refused by the shape check, naming the first tensor past them
        if num_layers_held is not None and _is_number(claimed) and claimed > num_layers_held:
            raise ModelLoadError(
                f"{config_path} says num_hidden_layers = {claimed}, but the tensors hold {num_layers_held} layers; "
                "the checkpoint is incomplete or for another model"
            )
        return ModelConfig.from_hf_dict(raw)
    except ModelLoadError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{config_path} is invalid ({type(e).__name__}: {e}); fix or re-download it") from e


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # JSON's 1e6 is a float


def _mlp_modules(config: ModelConfig, layer: int) -> list[str]:
    """The MLP's modules of one layer: a dense SwiGLU, or the router, the experts and the shared expert."""
    swiglu = ("gate_proj", "up_proj", "down_proj")
    moe = config.moe
    if moe is None or not moe.is_sparse(layer):
        return [f"mlp.{p}" for p in swiglu]
    names = ["mlp.gate"] + [f"mlp.experts.{e}.{p}" for e in range(moe.num_experts) for p in swiglu]
    if moe.shared_expert_intermediate_size:
        names += [f"mlp.shared_expert.{p}" for p in swiglu]
    if moe.shared_expert_gate:
        names.append("mlp.shared_expert_gate")
    return names


def expected_tensor_names(config: ModelConfig) -> list[str]:
    """Every HF tensor name a model with `config` must have (MoE layers as the model names them: moe_names)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    attention = _attention_modules(config)
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if config.arch.sandwich_norms else []
    norms += ["self_attn.q_norm", "self_attn.k_norm"] if config.qk_norm else []
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        names += [prefix + p + ".weight" for p in attention + _mlp_modules(config, i) + norms]
        if config.moe is not None and config.moe.score_bias and config.moe.is_sparse(i):
            names.append(prefix + "mlp.gate.e_score_correction_bias")  # DeepSeek-V3's routing bias
        if config.attention_bias:
            biased = (
                ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")
                if config.mla is not None
                else ("q_proj", "k_proj", "v_proj")
            )
            names += [prefix + f"self_attn.{p}.bias" for p in biased if f"self_attn.{p}" in attention]
    return names


def _attention_modules(config: ModelConfig) -> list[str]:
    """The attention's modules with weights: q/k/v/o, or MLA's (leanlm.model.mla)."""
    if config.mla is None:
        return ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    query = ["q_proj"] if config.mla.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    latent = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    return [f"self_attn.{m}" for m in query + latent]


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, in index order (one file when unsharded)."""
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{path / INDEX_FILE} is corrupt ({e}); re-download the model") from e
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{path / INDEX_FILE} has no weight_map object; re-download the model")
        for name in weight_map.values():
            if not isinstance(name, str) or not name:
                raise ModelLoadError(
                    f"{path / INDEX_FILE} maps a tensor to {name!r}, not a file name; re-download the model"
                )
        shards = [_shard_inside(path, name) for name in dict.fromkeys(weight_map.values())]
        for shard in shards:
            if not shard.is_file():
                raise ModelLoadError(
                    f"shard {shard.name} listed in {INDEX_FILE} is missing from {path}; "
                    "re-download the model (all shards are needed)"
                )
        return shards
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise ModelLoadError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}; it holds no weights we can load")


def _shard_inside(path: Path, name: str) -> Path:
    """The shard file `name` of the index, refused unless its name stays inside the model directory: an index
    may come from anyone, and must not make us read (or memory-map) files elsewhere by naming them. Symlinks
    placed in the directory are followed, as every loader does: whoever made them owns the directory's files
    anyway, and the Hugging Face hub cache links each snapshot's shards to ../../blobs."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise ModelLoadError(
            f"{path / INDEX_FILE} names shard {name!r} outside the model directory (absolute or "
            "'..' path); refusing it: shards must be files inside the directory"
        )
    return path / relative


def _read_shard(shard: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    check_safetensors_header(shard)  # bounded: the header length, JSON, dtypes, shapes and byte ranges
    try:
        with safe_open(str(shard), framework="pt") as f:
            # Float tensors go to `dtype`; integer ones (packed quantized weights) are kept as stored.
            return {name: _cast(f.get_tensor(name), dtype) for name in f.keys()}
    except Exception as e:  # safetensors raises SafetensorError / OSError on a short or corrupt file
        raise ModelLoadError(f"safetensors file {shard} is corrupt or truncated ({e}); re-download it") from e


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def load_hf_dir(
    path: str | Path, dtype: torch.dtype | None = torch.float32, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and every tensor of an HF directory; ModelLoadError when a required tensor is missing.

    Float tensors are cast to `dtype` (None keeps every tensor as stored: quantized checkpoints). A weight
    that a quantized layer replaces (`x.weight` absent, `x.qweight` etc. present) counts as present.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist; check the path")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in tqdm(shard_files(path), desc="loading safetensors", unit="shard", disable=not progress):
        state_dict.update(_read_shard(shard, dtype))
    # The counts the config may size anything from are those the tensors prove: its layers before it is built
    # (a config claiming 2**31 layers made the name check below spin), its experts before their names are listed
    # (num_local_experts 1e7 listed 3e7 names, 5 GB).
    num_layers = 1 + max((int(m.group(1)) for n in state_dict if (m := _LAYER_INDEX.match(n))), default=-1)
    config = read_hf_config(path, num_layers)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # the same tensor as the embedding; the model ties it
    try:
        state_dict = to_model_names(config, state_dict)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}; the checkpoint does not match its config") from e
    check_held_experts(config, state_dict, path / "config.json", _expert_count_key(config))
    modules = {name.rsplit(".", 1)[0] for name in state_dict}
    missing = [
        n
        for n in expected_tensor_names(config)
        if n not in state_dict and not (n.endswith(".weight") and n.removesuffix(".weight") in modules)
    ]
    if missing:
        raise ModelLoadError(
            f"{path} lacks {len(missing)} tensors the config requires (first: "
            f"{', '.join(missing[:3])}); the checkpoint is incomplete or for another model"
        )
    return config, state_dict


def save_hf_dir(
    path: str | Path, config: ModelConfig, state_dict: dict[str, torch.Tensor], max_shard_bytes: int = 2 << 30
) -> None:
    """Write `config.json` + safetensors shards (+ index when more than one) that `load_hf_dir` reads back.

    The weight files of a model saved there before are removed once the new ones are written: the reader takes
    an index over a single file, so an old index would silently load the old weights."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    if all(t.is_floating_point() for t in state_dict.values()):
        # a float model in its architecture's own names (Mixtral's w1/w2/w3), so HF and vLLM read it as theirs; a
        # quantized one keeps the model's names, which its layers' metadata uses
        state_dict = to_file_names(config, state_dict)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata={"format": "pt"})
        _remove_stale_weights(path, {SINGLE_FILE})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    _remove_stale_weights(path, {INDEX_FILE, *weight_map.values()})


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def _expert_count_key(config: ModelConfig) -> str | None:
    """The config.json key that gave the expert count, for the message (None: a leanlm_moe block's)."""
    kind = config.arch.moe
    if not kind:
        return None
    return {"mixtral": "num_local_experts", "deepseek": "n_routed_experts"}.get(kind, "num_experts")


def _remove_stale_weights(path: Path, written: set[str]) -> None:
    """Delete the index and weight files of the HF layout in `path` that this save did not write."""
    for entry in path.iterdir():
        name = entry.name
        if name not in written and (name == INDEX_FILE or _WEIGHT_FILE.fullmatch(name)) and entry.is_file():
            entry.unlink()
