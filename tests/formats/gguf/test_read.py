"""GGUF reading: the real SmolLM2 file against HF transformers, tiny synthetic files, and broken files."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from leanlm.config import RopeScaling
from leanlm.formats.gguf import load_gguf
from leanlm.formats.gguf.tensors import unpermute_rotary
from leanlm.loading.errors import ModelLoadError
from tests.loading.conftest import llama_cpp_permute, write_tiny_gguf


def test_smollm_config(smollm):
    c = smollm.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1
    assert c.eos_token_ids == (2, 0)  # eos = <|im_end|>, then <|endoftext|>


def test_smollm_state_dict_matches_hf(smollm, hf_smollm):
    ours = smollm.state_dict
    ref = {k: v for k, v in hf_smollm.state_dict().items() if k != "lm_head.weight"}  # tied: HF's is the embedding
    assert set(ours) == set(ref)
    assert len(ours) == 30 * 9 + 2
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        # torch.equal is the fast path (we match exactly); the tolerance is the contract.
        assert torch.equal(tensor, ref[name]) or (tensor - ref[name]).abs().max().item() <= 1e-6, name


def test_smollm_config_matches_hf(smollm, hf_smollm):
    hf = hf_smollm.config
    c = smollm.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.vocab_size) == (
        hf.hidden_size,
        hf.num_hidden_layers,
        hf.num_key_value_heads,
        hf.vocab_size,
    )
    assert c.rms_norm_eps == hf.rms_norm_eps and c.tie_word_embeddings == hf.tie_word_embeddings


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 8))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rotary(permuted, 8), w)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)])
def test_tiny_gguf_round_trip(tiny_gguf, arch, tied):
    path, expected = tiny_gguf(arch, tied)
    config, state_dict, meta = load_gguf(path, progress=False)
    assert config.architecture == arch and config.num_hidden_layers == 2 and config.head_dim == 16
    assert config.tie_word_embeddings == tied and ("lm_head.weight" in state_dict) == (not tied)
    assert config.attention_bias == (arch == "qwen2")
    assert config.vocab_size == len(meta.tokens)  # no {arch}.vocab_size key: taken from the token list
    assert config.eos_token_ids == (meta.tokens.index("<|im_end|>"), meta.tokens.index("<|endoftext|>"))
    assert set(state_dict) == set(expected)
    for name, tensor in expected.items():
        # llama Q/K come back un-permuted; qwen2 files were never permuted.
        torch.testing.assert_close(state_dict[name], tensor, atol=0, rtol=0, msg=name)


def test_dtype_and_progress_flag(tiny_gguf):
    path, expected = tiny_gguf("qwen2", True)
    _, state_dict, _ = load_gguf(path, dtype=torch.bfloat16, progress=True)
    assert all(t.dtype == torch.bfloat16 for t in state_dict.values())


def llama3_rope_factors(head_dim: int, theta: float, factor: float, orig_ctx: int = 8192) -> np.ndarray:
    """Per-frequency divisors as llama.cpp's converter writes them for Llama 3.1 (low 1, high 4)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    out = []
    for wavelen in 2 * np.pi / inv_freq:
        if wavelen < orig_ctx / 4:
            out.append(1.0)
        elif wavelen > orig_ctx / 1:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    path = tmp_path / "rope.gguf"
    write_tiny_gguf(path, "llama", rope_freqs=llama3_rope_factors(16, 10000.0, 8.0, orig_ctx=64))
    with pytest.raises(ModelLoadError, match="rope_freqs"):  # our 256-token ctx file has no orig ctx key: 8192
        load_gguf(path, progress=False)
    write_tiny_gguf(path, "llama", rope_freqs=llama3_rope_factors(16, 10000.0, 8.0))
    config, state_dict, _ = load_gguf(path, progress=False)
    assert config.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0)
    assert "rope_freqs.weight" not in state_dict and len(state_dict) == 2 * 9 + 2


# ---------------------------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf(bogus)


def test_truncated_real_file(smollm, tmp_path):
    short = tmp_path / "short.gguf"
    with open(smollm.source, "rb") as src, open(short, "wb") as dst:
        dst.write(src.read(40_000_000))  # header intact, tensor data cut
    with pytest.raises(ModelLoadError, match=r"truncated: expected \d+ bytes of tensor data, found \d+") as e:
        load_gguf(short, progress=False)
    assert "leanlm models pull" in str(e.value)


@pytest.mark.parametrize("keep", [8, 24, 300])
def test_truncated_header(tiny_gguf, tmp_path, keep):
    path, _ = tiny_gguf("llama", True)
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ModelLoadError, match="corrupt or truncated header"):
        load_gguf(short, progress=False)


def test_corrupt_metadata(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama", True)
    data = bytearray(path.read_bytes())
    pos = data.index(b"general.architecture") + len(b"general.architecture")
    data[pos : pos + 4] = b"\xff\xff\xff\x7f"  # value type -> garbage
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError):
        load_gguf(broken, progress=False)


def test_unsupported_architecture(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama", True)
    data = path.read_bytes().replace(
        b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gemma", 1
    )
    other = tmp_path / "other.gguf"
    other.write_bytes(data)
    with pytest.raises(ModelLoadError, match="architecture 'gemma' is not supported"):
        load_gguf(other, progress=False)


def test_copy_keeps_working_without_extension(tiny_gguf, tmp_path):
    path, expected = tiny_gguf("llama", True)
    renamed = tmp_path / "weights.bin"
    shutil.copy(path, renamed)
    _, state_dict, _ = load_gguf(renamed, progress=False)
    assert set(state_dict) == set(expected)


def _with_u32_field(path, key: str, value: int, tmp_path):
    """A copy of the GGUF at `path` whose uint32 metadata `key` holds `value` instead."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    offset = reader.fields[key].parts[-1].ctypes.data - reader.data.ctypes.data
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = value.to_bytes(4, "little")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(data))
    return broken


def test_metadata_that_disagrees_with_tensor_shapes(tiny_gguf, tmp_path):
    """A damaged feed_forward_length used to load (and fail later in the model); now the loader refuses it."""
    broken = _with_u32_field(tiny_gguf("llama", True)[0], "llama.feed_forward_length", 128, tmp_path)  # holds 96
    with pytest.raises(
        ModelLoadError,
        match=r"ffn_gate.weight has shape \[96, 64\], but the metadata describes "
        r"\[128, 64\]",
    ):
        load_gguf(broken, progress=False)


def test_absurd_context_length(tiny_gguf, tmp_path):
    broken = _with_u32_field(tiny_gguf("qwen2", True)[0], "qwen2.context_length", 2**32 - 1, tmp_path)
    with pytest.raises(
        ModelLoadError,
        match=r"invalid model: max_position_embeddings \(context length\) is "
        r"4294967295, above the 1048576 positions",
    ):
        load_gguf(broken, progress=False)
