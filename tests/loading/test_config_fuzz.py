"""Hostile config values (issue 47 items 2 and 3): every count, real, flag and rope_scaling of a config.json
directory and of GGUF metadata, set to zero, negative, huge (1e6, 1e7, 2**63), NaN, infinite or of the wrong type,
must end in a one-line ModelLoadError naming the field, fast and small, or (the few values that are sound) load.

Each case runs the whole loader, network build included (`load_checkpoint`), under `bounded`: a SIGALRM deadline
and a tracemalloc peak (Python and numpy allocations, which is where building a network on the meta device spent
its gigabytes); the process's peak RSS over all cases is bounded too (torch's own allocations)."""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import shutil

import pytest
import torch
from gguf import GGUFValueType as V

from leanlm.config.moe import MoEConfig
from leanlm.formats.hf_dir import save_hf_dir
from leanlm.formats.loader import load_checkpoint
from leanlm.loading.errors import ModelLoadError
from tests.conftest import tiny_config, tiny_state_dict
from tests.loading.conftest import bounded, write_tiny_gguf
from tests.tiny_tokenizer import tiny_tokenizer

SECONDS_PER_CASE = 20.0  # generous: a case takes milliseconds; the old code ran past 90 s on block_count 1e6
PEAK_BYTES_PER_CASE = 256 << 20  # the old code passed 2.5 GB on block_count 1e6, 5 GB on num_local_experts 1e7
MAX_RSS_GROWTH_BYTES = 512 << 20

# JSON values: ints, floats (1e6 parses as a float), NaN and infinity (Python's json reads them), wrong kinds
BAD_COUNTS = (0, -1, 10**7, 2**63, 1.5, math.nan, math.inf, "32", [2], {"n": 2}, True)
BAD_REALS = (0, -1, math.nan, math.inf, -math.inf, "1e-6", [1e-6], {"eps": 1e-6}, True)
BAD_FLAGS = ("true", 1, [], {"tied": True})
HF_CASES = (
    [(f, v) for f in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size") for v in BAD_COUNTS]
    + [(f, v) for f in ("num_attention_heads", "num_key_value_heads", "head_dim") for v in BAD_COUNTS]
    + [("num_hidden_layers", v) for v in (10**6, 1e6, None)]
    + [(f, None) for f in ("num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "hidden_size")]
    + [("max_position_embeddings", v) for v in (0, -1, 10**7, 2**63, math.nan, "2048", [2048], True)]
    + [("rms_norm_eps", v) for v in (*BAD_REALS, 2.0, 10**6)]
    + [("rope_theta", v) for v in BAD_REALS]
    + [("tie_word_embeddings", v) for v in BAD_FLAGS]
    + [("bos_token_id", v) for v in (-1, "1", [1], 1.5)]
    + [("eos_token_id", v) for v in (-1, "2", [[2]], {"id": 2}, math.nan)]
    + [("sliding_window", v) for v in (-1, "4", 1.5, [4])]
    + [
        ("rope_scaling", v)
        for v in (
            "lol",
            1,
            ["llama3"],
            {"rope_type": "llama3"},  # no factor
            {"rope_type": "llama3", "factor": math.nan},
            {"rope_type": "llama3", "factor": -8.0},
            {"rope_type": "llama3", "factor": "8"},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},  # 0 division
            {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 0},
            {"rope_type": "dynamic", "factor": 2.0},  # NTK-aware dynamic scaling: not supported
            {"rope_type": "yarn"},  # no factor
            {"rope_type": "yarn", "factor": 2.0, "beta_fast": -1.0},
            {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0]},  # no long factors
            {"rope_type": ["linear"], "factor": 2.0},
            {"type": "linear", "factor": math.inf},
        )
    ]
)
# null is HF's "not set": these fall back to their defaults (hidden / heads, 1e-6), which fit the tiny model
NULL_IS_SOUND = ("head_dim", "rms_norm_eps")  # a null num_key_value_heads means one per head: refused here
MOE_CASES = (
    [("num_local_experts", v) for v in (*BAD_COUNTS, 10**6, 1e7, 5)]
    + [("num_experts_per_tok", v) for v in (0, -1, 5, 10**7, math.nan, "2", [2], True)]
    + [("router_aux_loss_coef", v) for v in (-1.0, math.nan, math.inf, "0.01")]
)


# the ModelConfig (or MoEConfig) field a GGUF key or config.json key becomes, which its checks name
SAME_FIELD = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.dimension_count": "head_dim",
    "context_length": "max_position_embeddings",
    "expert_count": "num_experts",
    "num_experts_per_tok": "top_k",
}
# a count of the right kind that the tensors disprove is refused naming the first tensor it misdescribes
SHAPE_REFUSALS = ("but the model config gives", "but the metadata describes")


def _field_named(message: str, field: str) -> bool:
    names = (field, SAME_FIELD.get(field, field))
    return any(name in message for name in names) or any(s in message for s in SHAPE_REFUSALS)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny dense llama and a tiny Mixtral (4 experts), saved as config.json + safetensors + tokenizer."""
    tokenizer = tiny_tokenizer()
    root = tmp_path_factory.mktemp("config-fuzz")
    dense = tiny_config(tokenizer.vocab_size)
    moe = dataclasses.replace(
        dense, architecture="mixtral", moe=MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=128)
    )
    dirs = {}
    for name, config in (("dense", dense), ("moe", moe)):
        save_hf_dir(root / name, config, tiny_state_dict(config))
        tokenizer.save(root / name)
        load_checkpoint(root / name, progress=False)  # the intact ones load
        dirs[name] = root / name
    return dirs


def _with_config(source, tmp_path, field, value):
    path = tmp_path / "model"
    shutil.copytree(source, path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, field: value}))
    return path


def _outcome(path, field: str) -> str:
    """'loaded', or the refusal's message; anything else (another exception, a hang, a peak) fails the test."""
    with bounded(SECONDS_PER_CASE, PEAK_BYTES_PER_CASE):
        try:
            load_checkpoint(path, progress=False)
        except ModelLoadError as e:
            message = str(e)
            assert "\n" not in message, message
            assert _field_named(message, field), f"{field}: {message}"
            return message
    return "loaded"


@pytest.fixture(scope="module")
def rss_bound():
    """The process's peak RSS may grow by at most MAX_RSS_GROWTH_BYTES over all of this module's cases."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    yield
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert grown < MAX_RSS_GROWTH_BYTES, f"peak RSS grew {grown >> 20} MiB"


@pytest.mark.parametrize("field,value", HF_CASES, ids=lambda x: repr(x)[:40])
def test_hostile_config_json_values_are_refused(model_dirs, tmp_path, rss_bound, field, value):
    outcome = _outcome(_with_config(model_dirs["dense"], tmp_path, field, value), field)
    assert (outcome == "loaded") == (value is None and field in NULL_IS_SOUND), outcome


@pytest.mark.parametrize("field,value", MOE_CASES, ids=lambda x: repr(x)[:40])
def test_hostile_moe_config_values_are_refused(model_dirs, tmp_path, rss_bound, field, value):
    outcome = _outcome(_with_config(model_dirs["moe"], tmp_path, field, value), field)
    assert outcome != "loaded"


def test_the_named_findings(model_dirs, tmp_path):
    """The cases issue 47 reported, with the messages that replace a hang, 5 GB or an internal error."""
    big = _with_config(model_dirs["moe"], tmp_path / "experts", "num_local_experts", 10**7)
    with pytest.raises(ModelLoadError, match=r"num_local_experts is 10000000, but the file holds tensors of 4 experts"):
        with bounded(SECONDS_PER_CASE, PEAK_BYTES_PER_CASE):
            load_checkpoint(big, progress=False)
    lol = _with_config(model_dirs["dense"], tmp_path / "lol", "rope_scaling", "lol")
    with pytest.raises(ModelLoadError, match=r"rope_scaling must be an object \(a dict of named values\), got 'lol'"):
        load_checkpoint(lol, progress=False)
    nan = _with_config(model_dirs["dense"], tmp_path / "nan", "rms_norm_eps", math.nan)
    with pytest.raises(ModelLoadError, match=r"rms_norm_eps must be a finite number in \(0.0, 1.0\], got nan"):
        load_checkpoint(nan, progress=False)


# ---------------------------------------------------------------------------------------------- GGUF metadata

A = "llama."
# GGUF values of each kind: (value, type[, array item type])
GGUF_BAD_COUNTS = (
    (0, V.UINT32),
    (-1, V.INT32),
    (10**6, V.UINT32),
    (10**7, V.UINT32),
    (2**63, V.UINT64),
    (math.nan, V.FLOAT32),
    (math.inf, V.FLOAT32),
    (2.5, V.FLOAT64),
    ("32", V.STRING),
    ([2, 2], V.ARRAY, V.UINT32),
    (True, V.BOOL),
)
GGUF_BAD_REALS = (
    (0.0, V.FLOAT32),
    (-1.0, V.FLOAT32),
    (math.nan, V.FLOAT32),
    (math.inf, V.FLOAT64),
    ("1e-6", V.STRING),
    ([1e-6], V.ARRAY, V.FLOAT32),
    (True, V.BOOL),
)
COUNT_KEYS = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.dimension_count",
    "vocab_size",
)
GGUF_CASES = (
    [(A + k, v) for k in COUNT_KEYS for v in GGUF_BAD_COUNTS]
    + [(A + "context_length", v) for v in GGUF_BAD_COUNTS if v[0] != 10**6]
    + [(A + "attention.layer_norm_rms_epsilon", v) for v in (*GGUF_BAD_REALS, (2.0, V.FLOAT32))]
    + [(A + "rope.freq_base", v) for v in GGUF_BAD_REALS]
    + [(A + "rope.scaling.type", ("yarn", V.STRING)), (A + "rope.scaling.type", (7, V.UINT32))]
    + [(A + "expert_count", v) for v in GGUF_BAD_COUNTS if v[0] != 0]  # 0: a dense model
    + [(k, None) for k in (A + "block_count", A + "embedding_length", A + "attention.head_count")]
    + [("tokenizer.ggml.eos_token_id", v) for v in ((-1, V.INT32), ("2", V.STRING), (2**63, V.UINT64))]
    + [("tokenizer.ggml.bos_token_id", (-1, V.INT32))]
)


@pytest.mark.parametrize("key,value", GGUF_CASES, ids=lambda x: repr(x)[:40])
def test_hostile_gguf_metadata_values_are_refused(tmp_path, rss_bound, key, value):
    path = tmp_path / "case.gguf"
    extra = {}
    if key == A + "rope.scaling.type":  # a scaling type is read with its factor
        extra[A + "rope.scaling.factor"] = (2.0, V.FLOAT32)
    if key == A + "expert_count":  # with a top-k, so that the expert count itself is what is checked
        extra[A + "expert_used_count"] = (2, V.UINT32)
    write_tiny_gguf(path, "llama", metadata={key: value, **extra})
    outcome = _outcome(path, key.removeprefix(A))
    assert outcome != "loaded"


def test_the_named_gguf_findings(tmp_path):
    """block_count 1e6 over a 2-layer file built a million layers (no answer in 90 s); head_count 0 was an
    internal ZeroDivisionError; a NaN epsilon loaded and made the model emit token 0."""
    for key, value, message in (
        ("block_count", (10**6, V.UINT32), r"llama.block_count is 1000000, but the file holds tensors of 2 layers"),
        ("attention.head_count", (0, V.UINT32), r"llama.attention.head_count must be an integer in \[1, "),
        ("attention.layer_norm_rms_epsilon", (math.nan, V.FLOAT32), r"layer_norm_rms_epsilon must be a finite"),
    ):
        path = tmp_path / f"{key}.gguf"
        write_tiny_gguf(path, "llama", metadata={A + key: value})
        with pytest.raises(ModelLoadError, match=message):
            with bounded(SECONDS_PER_CASE, PEAK_BYTES_PER_CASE):
                load_checkpoint(path, progress=False)
    intact = tmp_path / "intact.gguf"
    write_tiny_gguf(intact, "llama")
    assert load_checkpoint(intact, progress=False).config.num_hidden_layers == 2
    assert torch.isfinite(next(load_checkpoint(intact, progress=False).model.parameters())).all()
