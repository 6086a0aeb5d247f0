"""Cost estimates against worked examples from the inference literature and against what our engine allocates."""

from __future__ import annotations

import pytest
import torch

from leanlm.analysis.estimate import (
    decode_flops_per_token,
    decode_step,
    decode_utilization,
    expected_experts_touched,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_format,
    matmul_flops_per_token,
    max_batch,
    param_counts,
    peak_activation_bytes,
    prefill_flops,
    prefill_step,
    roofline_time,
    serving_memory_bytes,
    weight_bytes,
    weight_format,
)
from leanlm.analysis.hardware_profiles import HARDWARE, Hardware, measure_matmul_flops
from leanlm.analysis.model_shape import PRESETS, ModelShape, load_shape, shape_from_config
from leanlm.config import EngineConfig
from leanlm.loading.registry import DEFAULT_MODEL

LLAMA_7B, LLAMA_70B, GPT3, MIXTRAL = (PRESETS[n] for n in ("llama-7b", "llama-2-70b", "gpt-3-175b", "mixtral-8x7b"))
FP16, BF16 = weight_format("fp16"), weight_format("bf16")


def kv16(shape: ModelShape):
    return kv_format("fp16", shape.head_dim)


@pytest.fixture(scope="module")
def smollm_shape():
    shape, _ = load_shape(DEFAULT_MODEL)  # GGUF metadata only
    return shape


# ---------------------------------------------------------------------------------------------- parameters


def test_parameter_counts_of_known_models():
    assert param_counts(LLAMA_7B).total == pytest.approx(6.74e9, rel=2e-3)  # "LLaMA-7B: 6.7B"
    assert param_counts(PRESETS["llama-2-13b"]).total == pytest.approx(13.0e9, rel=5e-3)
    assert param_counts(LLAMA_70B).total == pytest.approx(69.0e9, rel=2e-3)
    assert param_counts(GPT3).total == pytest.approx(175e9, rel=5e-3)
    assert param_counts(PRESETS["llama-3-8b"]).total == pytest.approx(8.03e9, rel=1e-3)


def test_llama_7b_parts_are_exact():
    p = param_counts(LLAMA_7B)
    assert p.embed_tokens == p.lm_head == 32000 * 4096
    assert p.attention == 32 * 4 * 4096 * 4096
    assert p.mlp == p.mlp_active == 32 * 3 * 4096 * 11008
    assert p.norms == 65 * 4096 and p.biases == p.router == p.position_embeddings == 0
    assert p.total == 6_738_415_616  # the HF LlamaForCausalLM count


def test_gqa_shrinks_k_and_v_only():
    p = param_counts(LLAMA_70B)
    assert p.attention == 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024)


def test_plain_mlp_has_two_matrices_and_gpt_biases():
    p = param_counts(GPT3)
    d = 12288
    assert p.mlp == 96 * 2 * d * 4 * d
    assert p.lm_head == 0 and p.position_embeddings == 2048 * d
    assert p.biases == 96 * (3 * d + d + 4 * d + d)  # q k v, o, up, down
    assert p.norms == (2 * 96 + 1) * 2 * d  # LayerNorm weight + bias


def test_moe_total_vs_active():
    p = param_counts(MIXTRAL)
    assert p.total == pytest.approx(46.7e9, rel=2e-3)  # "Mixtral 8x7B: 47B parameters, 13B active"
    assert p.active == pytest.approx(12.9e9, rel=2e-3)
    assert p.router == 32 * 4096 * 8
    assert p.mlp == 4 * p.mlp_active


def test_smollm2_135m_from_its_real_config(smollm_shape):
    p = param_counts(smollm_shape)
    assert smollm_shape.tie_word_embeddings and p.lm_head == 0
    assert p.total == pytest.approx(134.5e6, rel=1e-3)
    assert p.total == 134_515_008


# ---------------------------------------------------------------------------------------------- bytes


def test_weight_bytes_per_format():
    n = param_counts(LLAMA_7B).total
    assert weight_bytes(LLAMA_7B, weight_format("fp32")) == 4 * n
    assert weight_bytes(LLAMA_7B, FP16) == 2 * n
    matrices = param_counts(LLAMA_7B).attention + param_counts(LLAMA_7B).mlp
    rest = n - matrices
    assert weight_bytes(LLAMA_7B, weight_format("int8")) == matrices + 2 * rest
    assert weight_bytes(LLAMA_7B, weight_format("int4")) == matrices * 4.125 / 8 + 2 * rest
    assert weight_format("int4", group_size=32, zero_bits=16).bits_per_value == 5.0  # GGUF Q4_1
    assert weight_format("int4", group_size=64).bits_per_value == 4.25
    # 6.48e9 matrix weights at 4.125 bits (3.34 GB) + 0.26e9 embedding/lm_head weights in bf16 (0.52 GB)
    assert weight_bytes(LLAMA_7B, weight_format("int4")) / 1e9 == pytest.approx(3.86, abs=0.01)


def test_unknown_format_says_what_to_use():
    with pytest.raises(ValueError, match="fp32, bf16, fp16, fp8, int8, int4"):
        weight_format("int3")


def test_kv_cache_llama_7b_batch_64_at_2048():
    # 2 (K and V) * 2 bytes * 32 layers * 4096 * 2048 tokens * 64 sequences = 68.7 GB
    assert kv_cache_bytes(LLAMA_7B, kv16(LLAMA_7B), batch=64, context=2048) == 2 * 2 * 32 * 4096 * 2048 * 64
    assert kv_cache_bytes(LLAMA_7B, kv16(LLAMA_7B), 64, 2048) / 1e9 == pytest.approx(68.7, abs=0.05)


def test_kv_per_token_gpt3_and_gqa():
    assert kv_bytes_per_token(GPT3, kv16(GPT3)) == 2 * 2 * 96 * 12288  # 4.72 MB per token
    assert kv_bytes_per_token(GPT3, kv16(GPT3)) / 1e6 == pytest.approx(4.72, abs=0.005)
    assert kv_bytes_per_token(LLAMA_70B, kv16(LLAMA_70B)) == 2 * 2 * 80 * 8 * 128  # 8x less than MHA
    int8 = kv_format("int8", 128)
    assert kv_bytes_per_token(LLAMA_70B, int8) == 2 * 80 * 8 * (128 + 2)  # + an fp16 scale per head
    assert kv_bytes_per_token(LLAMA_70B, kv_format("fp8", 128)) == 2 * 80 * 8 * 128


def test_peak_activations_pick_the_largest_transient():
    s = LLAMA_7B
    T = 1024
    mlp = 3 * T * 11008 * 2
    assert peak_activation_bytes(s, T, T, logits_rows=1) == 2 * T * 4096 * 2 + mlp
    scores = 2 * 32 * T * T * 4
    eager = peak_activation_bytes(s, T, T, logits_rows=1, materialize_scores=True)
    assert eager == 2 * T * 4096 * 2 + T * 4 * 4096 * 2 + scores
    all_logits = peak_activation_bytes(s, T, T, logits_rows=T)
    assert all_logits == 2 * T * 4096 * 2 + T * 32000 * 4  # [T, V] fp32 beats the MLP for llama's vocab


# ---------------------------------------------------------------------------------------------- FLOPs


def test_decode_flops_are_about_twice_the_params_at_short_context():
    for s in (LLAMA_7B, LLAMA_70B, GPT3):
        assert decode_flops_per_token(s, 1) == pytest.approx(2 * param_counts(s).total, rel=0.02)
    assert matmul_flops_per_token(MIXTRAL) == pytest.approx(2 * param_counts(MIXTRAL).active, rel=0.02)


def test_attention_flops_grow_with_context():
    s = LLAMA_7B
    grow = decode_flops_per_token(s, 4097) - decode_flops_per_token(s, 1)
    assert grow == 2 * 2 * 32 * 4096 * 4096  # QK^T and AV over 4096 more keys
    # at 4k context the attention term is ~8% of a 7B model's per-token work
    assert grow / decode_flops_per_token(s, 1) == pytest.approx(0.16, abs=0.01)


def test_prefill_sums_the_causal_attention():
    s, n = LLAMA_7B, 512
    direct = sum(decode_flops_per_token(s, i) - 2 * 32000 * 4096 for i in range(1, n + 1)) + 2 * 32000 * 4096
    assert prefill_flops(s, n) == pytest.approx(direct, rel=1e-12)


# ---------------------------------------------------------------------------------------------- roofline


def test_decode_is_memory_bound_and_prefill_compute_bound_on_h100():
    h100 = HARDWARE["h100"]
    dec = decode_step(LLAMA_70B, BF16, kv_format("bf16", 128), batch=1, context=1024)
    assert dec.intensity == pytest.approx(1.0, rel=0.02)  # 2 FLOPs per 2-byte weight
    t = roofline_time(dec, h100, "bf16")
    assert t == pytest.approx(dec.bytes / 3.35e12)
    assert 1 / t == pytest.approx(24, rel=0.05)  # ~24 tokens/s: 138 GB of weights at 3.35 TB/s
    pre = prefill_step(LLAMA_70B, BF16, kv_format("bf16", 128), batch=1, prompt_len=2048)
    assert pre.intensity > h100.ridge_point
    assert roofline_time(pre, h100, "bf16") == pytest.approx(pre.flops / 989e12)


def test_batching_raises_decode_intensity_until_kv_dominates():
    kv = kv16(LLAMA_7B)
    b1, b64 = (decode_step(LLAMA_7B, FP16, kv, b, 128) for b in (1, 64))
    assert b64.intensity > 30 * b1.intensity
    long = decode_step(LLAMA_7B, FP16, kv, 64, 32768)
    assert long.intensity < b64.intensity / 4  # MHA KV reads swamp the weights at long context


def test_moe_decode_reads_only_touched_experts():
    assert expected_experts_touched(MIXTRAL, 1) == pytest.approx(2)
    assert expected_experts_touched(MIXTRAL, 64) == pytest.approx(8, rel=1e-6)
    kv = kv_format("bf16", 128)
    one, many = decode_step(MIXTRAL, BF16, kv, 1, 1), decode_step(MIXTRAL, BF16, kv, 64, 1)
    assert one.bytes / 1e9 == pytest.approx(2 * 12.9, rel=0.02)
    assert many.bytes / 1e9 == pytest.approx(2 * 46.7, rel=0.02)


def test_max_batch_fits_the_budget_exactly():
    kv = kv16(LLAMA_7B)
    budget = 80e9
    b = max_batch(LLAMA_7B, FP16, kv, context=2048, prompt_len=512, budget_bytes=budget)
    assert serving_memory_bytes(LLAMA_7B, FP16, kv, b, 2048, 512) <= budget
    assert serving_memory_bytes(LLAMA_7B, FP16, kv, b + 1, 2048, 512) > budget
    assert 60 <= b <= 62  # (80 GB - 13.5 GB of weights) / 1.07 GB per 2048-token sequence
    assert max_batch(LLAMA_70B, FP16, kv16(LLAMA_70B), 2048, 512, 80e9) == 0  # 138 GB of weights


def test_mbu_and_mfu_from_measured_throughput():
    h100 = HARDWARE["h100"]
    kv = kv_format("bf16", 128)
    step = decode_step(LLAMA_70B, BF16, kv, 1, 1024)
    at_roofline = 1 / roofline_time(step, h100, "bf16")
    u = decode_utilization(LLAMA_70B, BF16, kv, h100, batch=1, context=1024, tokens_per_s=at_roofline / 2)
    assert u.mbu == pytest.approx(0.5)
    assert u.mfu == pytest.approx(step.flops * at_roofline / 2 / 989e12)
    with pytest.raises(ValueError, match="tokens_per_s"):
        decode_utilization(LLAMA_70B, BF16, kv, h100, 1, 1024, 0)


def test_hardware_profiles_and_measured_matmul():
    assert HARDWARE["h100"].ridge_point == pytest.approx(295, rel=0.01)
    assert HARDWARE["a100"].ridge_point == pytest.approx(153, rel=0.01)
    flops = measure_matmul_flops(torch.float32, torch.device("cpu"), n=256, repeats=2)
    assert 1e8 < flops < 1e14
    with pytest.raises(ValueError, match="positive"):
        Hardware("x", 0, 1, 1, 1, "")


def test_shape_validation_says_what_to_do():
    with pytest.raises(ValueError, match="multiple of"):
        ModelShape("x", 10, 8, 8, 1, 3, 2, 4)
    with pytest.raises(ValueError, match="num_experts=1"):
        ModelShape("x", 10, 8, 8, 1, 2, 2, 4, num_experts=2, experts_per_token=3)
    with pytest.raises(ValueError, match="max_context must be >= 1"):
        ModelShape("x", 10, 8, 8, 1, 2, 2, 4, max_context=0)
    with pytest.raises(ValueError, match="preset"):
        load_shape("no-such-model")


# ---------------------------------------------------------------------------------------------- our engine


def test_kv_estimate_matches_what_the_engine_allocates(smollm_shape):
    from leanlm.engine.model_runner import ModelRunner
    from leanlm.formats.gguf import open_gguf
    from leanlm.formats.gguf.config import gguf_model_config
    from leanlm.loading.registry import resolve_model
    from leanlm.model.llama import LlamaForCausalLM

    config = gguf_model_config(open_gguf(resolve_model(DEFAULT_MODEL)))
    assert shape_from_config(config, name=DEFAULT_MODEL) == smollm_shape
    with torch.device("meta"):  # the runner allocates the real KV tensor; the weights do not matter here
        model = LlamaForCausalLM(config)
    budget = 48 << 20
    runner = ModelRunner(
        model, EngineConfig(kv_cache_memory_bytes=budget, block_size=16), torch.device("cpu"), torch.bfloat16
    )
    allocated = runner.kv_cache.nbytes
    tokens = runner.num_blocks * runner.block_size
    per_token = kv_bytes_per_token(smollm_shape, kv_format("bf16", smollm_shape.head_dim))
    assert per_token == allocated / tokens  # exact: the engine pads nothing
    assert kv_cache_bytes(smollm_shape, kv_format("bf16", 64), 1, tokens) == pytest.approx(allocated, rel=0.05)
    assert allocated == pytest.approx(budget, rel=0.05)  # whole blocks, so a little under the budget
    assert tokens == pytest.approx(budget / per_token, rel=0.05)
    # the int8 cache: one byte per value + a float32 scale per (token, KV head), exactly
    runner = ModelRunner(
        model, EngineConfig(kv_cache_memory_bytes=budget, kv_cache_dtype="int8"), torch.device("cpu"), torch.bfloat16
    )
    int8 = kv_format("int8", smollm_shape.head_dim, scale_bits=32)
    assert kv_bytes_per_token(smollm_shape, int8) == runner.kv_cache_bytes / (runner.num_blocks * runner.block_size)
    assert kv_format("fp8_e4m3", 64) == kv_format("fp8", 64)
