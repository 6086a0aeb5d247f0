"""The decoder against HF transformers on tiny random models, through the paged cache in chunks."""

import math

import pytest
import torch

from leanlm.config import ModelConfig, RopeScaling
from leanlm.model.attention import available_backends, get_backend
from leanlm.model.context import build_forward_context, forward_context, get_forward_context
from leanlm.model.layers import rope_inv_freq
from leanlm.model.llama import build_model
from leanlm.model.paged_kv import PagedKVCache

transformers = pytest.importorskip("transformers")


def _hf_pair(arch: str, tie: bool, rope_scaling: dict | None = None):
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rope_scaling=rope_scaling,
    )
    if arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    hf = hf.eval().double()
    cfg_dict = hf.config.to_dict() | {"model_type": arch}
    cfg = ModelConfig.from_hf_dict(cfg_dict)
    sd = {k: v for k, v in hf.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    return hf, build_model(cfg, sd, torch.float64)


# float64 everywhere but the float32 rotary table (HF rounds its own table differently): ~1e-7 apart.
def _paged_logits(model, ids: torch.Tensor, chunks: list[int], block_ids: list[int], block_size: int = 4):
    cfg = model.config
    cache = PagedKVCache.allocate(
        cfg.num_hidden_layers, 16, cfg.cache_kv_heads, block_size, cfg.cache_head_dim, torch.float64, "cpu"
    )
    done, outs = 0, []
    for n in chunks:
        blocks = block_ids[: math.ceil((done + n) / block_size)]
        ctx = build_forward_context([n], [done + n], [blocks], cache)
        with forward_context(ctx):
            hidden = model(ids[done : done + n], torch.arange(done, done + n))
        outs.append(model.compute_logits(hidden))
        done += n
    return torch.cat(outs)


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", False)])
def test_chunked_paged_forward_matches_hf(arch, tie):
    hf, ours = _hf_pair(arch, tie)
    ids = torch.randint(0, 101, (15,), generator=torch.Generator().manual_seed(1))
    ref = hf(ids[None]).logits[0]
    # prefill in uneven chunks over scattered blocks, then single-token decodes
    got = _paged_logits(ours, ids, [6, 5, 1, 1, 1, 1], block_ids=[9, 2, 14, 5])
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


def test_batched_decode_and_prefill_in_one_forward():
    hf, ours = _hf_pair("llama", True)
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 101, (9,), generator=gen), torch.randint(0, 101, (6,), generator=gen)
    cache = PagedKVCache.allocate(ours.config.num_hidden_layers, 16, 2, 4, 16, torch.float64, "cpu")
    blocks_a, blocks_b = [0, 1, 2], [5, 6]
    # step 1: a's first 8 tokens; step 2: a decodes its 9th token while b prefills all 6 in the same batch
    ctx = build_forward_context([8], [8], [blocks_a[:2]], cache)
    with forward_context(ctx):
        ours(a[:8], torch.arange(8))
    ctx = build_forward_context([1, 6], [9, 6], [blocks_a, blocks_b], cache)
    with forward_context(ctx):
        hidden = ours(torch.cat([a[8:], b]), torch.cat([torch.tensor([8]), torch.arange(6)]))
    logits = ours.compute_logits(hidden)
    torch.testing.assert_close(logits[0], hf(a[None]).logits[0, -1], atol=1e-6, rtol=0)
    torch.testing.assert_close(logits[1:], hf(b[None]).logits[0], atol=1e-6, rtol=0)


def test_llama3_rope_scaling_matches_hf():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf, ours = _hf_pair("llama", True, rope_scaling=scaling)
    assert ours.config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    ids = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        _paged_logits(ours, ids, [40], list(range(10))), hf(ids[None]).logits[0], atol=1e-6, rtol=0
    )
    plain = rope_inv_freq(16, 10000.0, None)
    scaled = rope_inv_freq(16, 10000.0, ours.config.rope_scaling)
    assert torch.equal(scaled[0], plain[0])  # the highest frequency is kept
    assert torch.allclose(scaled[-1], plain[-1] / 8)  # the lowest is divided by the factor


def test_forward_context_refuses_nesting_and_absence():
    ctx = build_forward_context([1], [1], [[0]], PagedKVCache.allocate(1, 1, 1, 4, 8, torch.float32, "cpu"))
    with forward_context(ctx):
        with pytest.raises(RuntimeError, match="already set"):
            with forward_context(ctx):
                pass
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()


def test_backend_registry():
    assert "torch" in available_backends()
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


def test_build_model_rejects_mismatched_checkpoint():
    _, ours = _hf_pair("llama", True)
    sd = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight"}
    del sd["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        build_model(ours.config, sd, torch.float32)
