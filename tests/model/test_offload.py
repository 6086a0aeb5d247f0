"""Weight offloading: streamed layers give the resident model's logits bit for bit, in a dense and a 4-bit format,
while the model's materialized weights stay within the budget; bad budgets fail with the minimum."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from leanlm.model.context import build_forward_context, forward_context
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.llama import build_model
from leanlm.model.offload import module_tensors, offload_layers, plan_offload, weight_bytes
from leanlm.model.packed_cache import PackedCache
from leanlm.model.paged_kv import PagedKVCache
from tests.conftest import tiny_config, tiny_state_dict

NUM_LAYERS = 6
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _config():
    return dataclasses.replace(tiny_config(256, "qwen2"), num_hidden_layers=NUM_LAYERS)


def _int_group_layers(config, seed: int = 1) -> dict[str, IntGroupWeightOnlyLinear]:
    """Random 4-bit codes (group 32) for every linear of every layer."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "self_attn.q_proj": (config.num_attention_heads * config.head_dim, config.hidden_size),
        "self_attn.k_proj": (config.num_key_value_heads * config.head_dim, config.hidden_size),
        "self_attn.v_proj": (config.num_key_value_heads * config.head_dim, config.hidden_size),
        "self_attn.o_proj": (config.hidden_size, config.num_attention_heads * config.head_dim),
        "mlp.gate_proj": (config.intermediate_size, config.hidden_size),
        "mlp.up_proj": (config.intermediate_size, config.hidden_size),
        "mlp.down_proj": (config.hidden_size, config.intermediate_size),
    }
    layers = {}
    for i in range(config.num_hidden_layers):
        for name, (n, k) in shapes.items():
            codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
            scales = torch.rand(n, k // 32, generator=g) / 16 + 1e-3
            bias = torch.randn(n, generator=g) * 0.1 if config.attention_bias and name[-6] in "qkv" else None
            layers[f"model.layers.{i}.{name}"] = IntGroupWeightOnlyLinear(
                codes, scales, -8 * scales, bias, bits=4, group_size=32
            )
    return layers


def _model(fmt: str):
    config = _config()
    state = tiny_state_dict(config, seed=0)
    quantized = None
    if fmt == "int_group":
        quantized = _int_group_layers(config)
        prefixes = tuple(quantized)
        state = {k: v for k, v in state.items() if not k.startswith(prefixes)}
    model = build_model(config, state, torch.bfloat16, quantized=copy.deepcopy(quantized))
    model.allow_native_decode = False  # the offloaded model runs the PyTorch path: compare like with like
    return model


def _logits(model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """A 12-token prefill (the packed GEMM's rows) then one-token decode steps (the GEMV's), paged."""
    cfg, block_size = model.config, 4
    cache = PagedKVCache.allocate(
        cfg.num_hidden_layers, 16, cfg.num_key_value_heads, block_size, cfg.head_dim, torch.bfloat16, "cpu"
    )
    done, outs = 0, []
    for n in chunks:
        blocks = list(range(math.ceil((done + n) / block_size)))
        with forward_context(build_forward_context([n], [done + n], [blocks], cache)):
            hidden = model(ids[done : done + n], torch.arange(done, done + n))
        outs.append(model.compute_logits(hidden))
        done += n
    return torch.cat(outs)


def _total_bytes(model) -> int:
    return weight_bytes(module_tensors(model))


@pytest.mark.parametrize("fmt", ["bf16", "int_group"])
def test_offloaded_forward_equals_resident_forward(fmt, tmp_path):
    resident, offloaded = _model(fmt), _model(fmt)
    total = _total_bytes(offloaded)
    layer = weight_bytes(module_tensors(offloaded.model.layers[0]))
    limit = total - layer  # 5 of 6 layers' room: 3 resident, a window of 2, 3 streamed
    streamer = offload_layers(offloaded, limit, directory=tmp_path)
    assert streamer is not None and len(streamer.plan.streamed_idx) == 3
    assert _total_bytes(offloaded) == total - 3 * layer  # the streamed layers left the resident set
    assert list(tmp_path.iterdir()) == []  # the layers' file is unlinked once open
    ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(3))
    chunks = [12, 1, 1, 1, 1]
    want, got = _logits(resident, ids, chunks), _logits(offloaded, ids, chunks)
    assert got.dtype is torch.bfloat16
    assert torch.equal(got, want)
    assert streamer.num_prefetch_hits > 0  # the reads overlapped: each layer found its prefetch
    streamer.close()


def test_window_never_exceeds_the_budget(tmp_path):
    model = _model("bf16")
    layer = weight_bytes(module_tensors(model.model.layers[0]))
    limit = _total_bytes(model) - 2 * layer + layer // 2  # room for 2 resident layers and the window, not 3
    streamer = offload_layers(model, limit, directory=tmp_path)
    plan = streamer.plan
    assert plan.resident_idx == (0, NUM_LAYERS - 1)  # first and last stay, the middle streams
    assert plan.peak_bytes <= limit < plan.peak_bytes + layer
    seen = []

    def measure(module, *args):  # after the streamer's hooks: the layer about to run (or just run) is in place
        in_model = _total_bytes(model)
        pending = streamer._pending  # a read in flight holds its layer's bytes outside the model
        seen.append(in_model + (0 if pending is None else plan.layer_bytes[pending[0]]))

    for block in model.model.layers:
        block.register_forward_pre_hook(measure)
        block.register_forward_hook(measure)
    _logits(model, torch.arange(20) % 256, [12, 1, 1, 1, 1, 1, 1, 1, 1])
    assert max(seen) <= limit
    assert max(seen) == plan.resident_bytes + plan.window_bytes  # the window is used, not just budgeted
    assert streamer.peak_live_bytes == plan.window_bytes
    streamed = [model.model.layers[i] for i in plan.streamed_idx]
    assert all(t.is_meta for block in streamed for t in module_tensors(block))  # released after the step
    # the 12-row prefill packed each layer's weights for the GEMM (where the CPU has it: AVX512-BF16); no copy
    # outlived its layer's run
    from leanlm.kernels import cpu_gemm

    resident = _model("bf16")
    _logits(resident, torch.arange(12), [12])
    assert all(_packed_copies(resident.model.layers[i]) for i in range(NUM_LAYERS)) == cpu_gemm.is_available()
    assert not any(_packed_copies(model.model.layers[i]) for i in range(NUM_LAYERS))
    streamer.close()


def _packed_copies(layer) -> list:
    caches = [c for m in layer.modules() for c in vars(m).values() if isinstance(c, PackedCache)]
    return [c.value for c in caches if c.value is not None]


def test_out_of_order_layers_read_on_the_spot(tmp_path):
    """A layer that was not prefetched (a self-speculation draft runs only the first layers) is read when it runs."""
    resident, offloaded = _model("bf16"), _model("bf16")
    layer = weight_bytes(module_tensors(offloaded.model.layers[0]))
    streamer = offload_layers(offloaded, _total_bytes(offloaded) - layer, tmp_path)
    ids = torch.arange(13) % 256
    first = offloaded.first_layers(3), resident.first_layers(3)
    assert torch.equal(_logits(first[0], ids, [12, 1]), _logits(first[1], ids, [12, 1]))
    assert torch.equal(_logits(offloaded, ids, [12, 1]), _logits(resident, ids, [12, 1]))
    streamer.close()


def test_a_budget_that_fits_everything_changes_nothing(tmp_path):
    model = _model("bf16")
    assert offload_layers(model, _total_bytes(model), tmp_path) is None
    assert all(not t.is_meta for t in module_tensors(model))


def test_a_budget_below_the_window_says_the_minimum():
    model = _model("int_group")
    plan_layer = max(weight_bytes(module_tensors(block)) for block in model.model.layers)
    fixed = _total_bytes(model) - NUM_LAYERS * plan_layer
    with pytest.raises(ValueError, match=f"give at least {fixed + 2 * plan_layer:,} bytes"):
        plan_offload(model, fixed + 2 * plan_layer - 1)
    assert plan_offload(model, fixed + 2 * plan_layer).streamed_idx == tuple(range(NUM_LAYERS))


@pytest.mark.gpu
def test_offloaded_forward_on_cuda_equals_resident():
    config = _config()
    state = tiny_state_dict(config, seed=0)
    resident = build_model(config, state, torch.bfloat16, device="cuda")
    offloaded = build_model(config, state, torch.bfloat16, device="cuda")
    layer = weight_bytes(module_tensors(offloaded.model.layers[0]))
    streamer = offload_layers(offloaded, _total_bytes(offloaded) - layer)
    assert torch.cuda.memory_allocated() > 0
    ids = torch.randint(0, 256, (14,), device="cuda")
    cfg = config
    outs = []
    for model in (resident, offloaded):
        cache = PagedKVCache.allocate(
            cfg.num_hidden_layers, 16, cfg.num_key_value_heads, 4, cfg.head_dim, torch.bfloat16, "cuda"
        )
        logits = []
        for start, n in ((0, 12), (12, 1), (13, 1)):
            blocks = list(range(math.ceil((start + n) / 4)))
            ctx = build_forward_context([n], [start + n], [blocks], cache)
            with forward_context(ctx):
                hidden = model(ids[start : start + n], torch.arange(start, start + n, device="cuda"))
            logits.append(model.compute_logits(hidden))
        outs.append(torch.cat(logits))
    assert torch.equal(outs[0], outs[1])
    assert streamer.num_prefetch_hits > 0
    streamer.close()


@pytest.mark.real_model
@pytest.mark.parametrize("dequantize", [True, False], ids=["bf16", "gguf_codes"])
def test_smollm2_offloaded_at_half_its_weights_generates_the_same_tokens(dequantize):
    """Dense bf16: a budget of half the weight bytes. GGUF codes: the embedding and head (bf16 + int8) are more
    than half of SmolLM2's 4-bit weights, so the budget is them plus half of the decoder layers."""
    from leanlm import LLM, SamplingParams

    options = dict(progress=False, kv_cache_memory_bytes=64 << 20, dequantize_gguf=dequantize, dtype="bfloat16")
    params = SamplingParams(max_tokens=16, temperature=0.0)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    plain = LLM(**options)
    model = plain.llm_engine.model
    # the offloaded model runs the per-layer path: the baseline too, so both run the same kernels on any CPU
    model.allow_native_decode = False
    total = _total_bytes(model)
    layers = sum(weight_bytes(module_tensors(block)) for block in model.model.layers)
    limit = total // 2 if dequantize else total - layers // 2
    want = [out.outputs[0].token_ids for out in plain.generate(prompts, params, use_tqdm=False)]
    del plain, model
    half = LLM(**options, max_weight_memory=limit)
    plan = half.offloaded.plan
    assert len(plan.streamed_idx) >= half.model_config.num_hidden_layers // 3
    assert plan.peak_bytes <= limit
    got = [out.outputs[0].token_ids for out in half.generate(prompts, params, use_tqdm=False)]
    assert got == want and len(want[0]) == 16
    assert half.offloaded.peak_live_bytes <= plan.window_bytes
    assert half.offloaded.num_prefetch_hits > 0


@pytest.mark.real_model
def test_llm_with_a_budget_below_the_window_names_the_minimum():
    from leanlm import LLM

    with pytest.raises(ValueError, match=r"max_weight_memory=1,000,000 bytes cannot hold .* give at least"):
        LLM(progress=False, kv_cache_memory_bytes=16 << 20, max_weight_memory="1MB")
