"""Fuzzing the quantized-checkpoint loaders: `python -m tests.loading.quantized_fuzz SEED CASES` saves one tiny
checkpoint per format (LeanLM int8 / grouped int4 with an act-order permutation / LLM.int8(), GPTQ, and
compressed-tensors 2:4 and bitmask), then mutates seeded copies of them (tensor shapes, dtypes and index values,
layer metadata, the config and its quantization block), loads each with `LLM` and generates a few tokens. Every
case must end either refused (ModelLoadError) or run with finite logprobs; anything else (another exception, a
hang past the per-case alarm) is a finding. One JSON line per case goes to stdout, then the process's peak RSS; the test
(test_quantized_fuzz.py) runs this in a child process, so a crash is a finding too, not the end of pytest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import resource
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from leanlm import LLM, SamplingParams
from leanlm.compress import GPTQConfig, LLMInt8Config, MagnitudeConfig, RTNConfig, compress
from leanlm.formats import Checkpoint, save_checkpoint, save_gptq_checkpoint
from leanlm.formats.compressed_tensors import save_compressed_tensors_checkpoint
from leanlm.loading.errors import ModelLoadError
from leanlm.model.linear.base import LINEAR_FORMATS
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict
from tests.tiny_tokenizer import tiny_tokenizer

SECONDS_PER_CASE = 20  # a hang is a finding
ODD_VALUES = (0, -1, 1, 3, 7, 31, 2**40, -(2**40), "32", None, 1.5, True, [], {})
CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


class CaseTimeout(Exception):
    pass


def base_checkpoints(root: Path) -> dict[str, Path]:
    """One intact checkpoint per format, of a tiny model whose heads the native decode loop runs."""
    tokenizer = tiny_tokenizer()
    cfg = dataclasses.replace(
        tiny_config(tokenizer.vocab_size), num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )
    calib = torch.randint(0, tokenizer.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    recipes = {
        "int8": (save_checkpoint, [RTNConfig(bits=8)]),
        "int4_perm": (save_checkpoint, [GPTQConfig(bits=4, group_size=32)]),
        "llm_int8": (save_checkpoint, [LLMInt8Config()]),
        "gptq": (save_gptq_checkpoint, [GPTQConfig(bits=4, group_size=32, symmetric=True)]),
        "sparse24": (save_compressed_tensors_checkpoint, MagnitudeConfig(pattern="2:4")),
        "bitmask": (save_compressed_tensors_checkpoint, MagnitudeConfig(sparsity=0.6)),
    }
    paths = {}
    for name, (save, recipe) in recipes.items():
        model = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.float32)
        compress(model, recipe, calib, progress=False)
        path = root / name
        if save is save_checkpoint:
            save(Checkpoint(model, tokenizer), path, dtype=torch.float32)
        else:
            save(Checkpoint(model, tokenizer), path)
        paths[name] = path
    return paths


# ------------------------------------------------------------------------------------------------ mutations


def _mutate_tensor(rng: random.Random, t: torch.Tensor) -> torch.Tensor | None:
    """One random change of shape, dtype or values; None deletes the tensor."""
    kind = rng.choice(["drop", "grow", "flatten", "scalar", "dtype", "values", "transpose", "empty", "delete"])
    if kind == "delete":
        return None
    if kind == "scalar" and t.numel():
        return t.reshape(-1)[:1].reshape(())
    if kind == "flatten" or t.dim() == 0 or t.numel() == 0:
        return t.reshape(-1)
    dim = rng.randrange(t.dim())
    if kind == "drop" and t.shape[dim] > 1:
        return t.narrow(dim, 0, t.shape[dim] - 1)
    if kind == "grow":
        return torch.cat([t, t.narrow(dim, 0, 1)], dim)
    if kind == "dtype":
        return t.to(rng.choice([torch.float32, torch.int32, torch.int64, torch.uint8, torch.int8, torch.float16]))
    if kind == "transpose" and t.dim() == 2:
        return t.t()
    if kind == "empty":
        return t.narrow(dim, 0, 0)
    if t.is_floating_point():  # "values": a few entries far out of range
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([1e30, -1e30, 0.0])
        return t
    info = torch.iinfo(t.dtype)
    t = t.clone()
    for _ in range(rng.randint(1, 3)):
        t.view(-1)[rng.randrange(t.numel())] = rng.randint(max(info.min, -(2**40)), min(info.max, 2**40))
    return t


def _mutate_weights(rng: random.Random, path: Path) -> str:
    files = sorted(path.glob("*.safetensors"))
    file = rng.choice(files)
    state = load_file(str(file))
    layer_tensors = [n for n in state if ".layers." in n and not n.endswith("layernorm.weight")]
    name = rng.choice(layer_tensors)
    if rng.random() < 0.1:  # a tensor the layer does not have, of a wrong length
        prefix = name.rsplit(".", 1)[0]
        state[prefix + rng.choice([".bias", ".perm", ".g_idx", ".row_offsets"])] = torch.zeros(3, dtype=torch.int64)
        what = f"extra tensor beside {name}"
    else:
        mutated = _mutate_tensor(rng, state[name])
        what = f"{name} {tuple(state[name].shape)} {state[name].dtype} -> " + (
            "deleted" if mutated is None else f"{tuple(mutated.shape)} {mutated.dtype}"
        )
        if mutated is None:
            del state[name]
        else:
            state[name] = mutated.contiguous()
    save_file(state, str(file), metadata={"format": "pt"})
    return what


def _mutate_layer_meta(rng: random.Random, path: Path) -> str:
    file = path / "quantization_config.json"
    meta = json.loads(file.read_text())
    name = rng.choice(sorted(meta["layers"]))
    layer = meta["layers"][name]
    kind = rng.choice(["set", "delete", "unknown", "format"])
    key = rng.choice(sorted(layer))
    if kind == "set":
        layer[key] = rng.choice(ODD_VALUES)
    elif kind == "delete":
        del layer[key]
    elif kind == "unknown":
        layer[rng.choice(["zero_point", "perm", "qweight", "bias"])] = rng.choice(ODD_VALUES)
    else:
        layer["format"] = rng.choice(sorted(LINEAR_FORMATS))
    file.write_text(json.dumps(meta))
    return f"{name} metadata {kind} {key}: {layer.get(key, '<gone>')!r}"


def _mutate_config(rng: random.Random, path: Path) -> str:
    file = path / "config.json"
    config = json.loads(file.read_text())
    block = config.get("quantization_config")
    if block and rng.random() < 0.5:
        key = rng.choice(sorted(k for k in block if not isinstance(block[k], dict)) or ["bits"])
        block[key] = rng.choice(ODD_VALUES + (2, 4, 8, 64, 128))
        what = f"quantization_config.{key} = {block[key]!r}"
    else:
        key = rng.choice(CONFIG_FIELDS)
        config[key] = rng.choice([0, 1, 2, 16, 32, 48, 96, 256, 2**31, -4, "64", None])
        what = f"config.{key} = {config[key]!r}"
    file.write_text(json.dumps(config))
    return what


def mutate(rng: random.Random, path: Path) -> list[str]:
    """1-2 random mutations of the checkpoint directory at `path`, described."""
    choices = [_mutate_weights, _mutate_weights, _mutate_config]
    if (path / "quantization_config.json").is_file():
        choices += [_mutate_layer_meta, _mutate_layer_meta]
    return [rng.choice(choices)(rng, path) for _ in range(rng.randint(1, 2))]


# ------------------------------------------------------------------------------------------------ outcome


def outcome(path: Path) -> tuple[str, str]:
    """("refused", why), ("ran", "") or ("finding", what went wrong)."""

    def expire(signum, frame):
        raise CaseTimeout

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(SECONDS_PER_CASE)
    try:
        llm = LLM(str(path), dtype="bfloat16", progress=False, kv_cache_memory_bytes=4 << 20)
        params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1, temperature=0.0)
        outputs = llm.generate([[5, 6, 7, 8], [9, 10]], params, use_tqdm=False)
        values = [v for out in outputs for lp in out.outputs[0].logprobs for v in lp.values()]
        if not values or not all(math.isfinite(v) for v in values):
            return "finding", "generated non-finite logprobs"
        return "ran", ""
    except ModelLoadError as e:
        return "refused", str(e)[:200]
    except CaseTimeout:
        return "finding", f"still running after {SECONDS_PER_CASE} s"
    except Exception as e:  # noqa: BLE001 (any other exception is what this fuzzer looks for)
        return "finding", f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.alarm(0)


def main(seed: int, num_cases: int) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        bases = base_checkpoints(Path(tmp) / "base")
        for name, path in bases.items():  # the intact ones run
            print(json.dumps({"base": name, "mutations": [], "outcome": outcome(path)}), flush=True)
        for case in range(num_cases):
            name = rng.choice(sorted(bases))
            path = Path(tmp) / f"case{case}"
            shutil.copytree(bases[name], path)
            mutations = mutate(rng, path)
            print(json.dumps({"base": name, "mutations": mutations, "outcome": outcome(path)}), flush=True)
            shutil.rmtree(path)
    print(json.dumps({"max_rss_kib": peak_rss_kib()}), flush=True)


def peak_rss_kib() -> int:
    """This process's peak resident memory. VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over from
    the parent through fork and exec (a child of a 6 GB pytest reports 6 GB), VmHWM belongs to this image."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
