"""The native decode loop (decode_layers.c) against the PyTorch path it replaces: bit-identical hidden states
over several decode steps, for bf16, int8 (per channel and group-wise), int4, act-order int4, W8A8, int4 / int8
with int8 activations (W4A8 / W8A8-dynamic), 2:4 sparse
and unstructured (bitmask) sparse linears (all of them, some among bf16 ones, and on a CPU without the sparse
kernels), with
and without q/k/v biases, batch 1, 3 (the GEMV kernels) and 12 (the packed GEMM), over bf16 and int8 KV
caches, on any thread count; when it steps aside (fp8 KV cache, the torch backend, layers it has no format
for); that it is rebuilt when the weights change (compress(), a dtype cast, an in-place edit); its row
helpers; and greedy SmolLM2 output unchanged by it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from leanlm.compress import ActivationSparsityConfig, MagnitudeConfig, RTNConfig, compress
from leanlm.config import ModelConfig
from leanlm.config.moe import MoEConfig, RoutingPolicy
from leanlm.kernels import cpu_bitmask, cpu_decode, cpu_rows, cpu_sparse, cpu_w8a8
from leanlm.kernels.build import NativeKernel
from leanlm.model.context import ExpertRouting, build_forward_context, forward_context
from leanlm.model.linear.act_quant import activation_quant, resolve_activation_quant
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.linear.bitmask import BitmaskSparseLinear, to_bitmask
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.linear.sparse24 import Sparse24Linear, to_sparse24
from leanlm.model.linear.sparse24_quant import Sparse24Int4Linear, Sparse24Int8Linear
from leanlm.model.llama import build_model
from leanlm.model.moe import moe_blocks
from leanlm.model.paged_kv import PagedKVCache
from tests.conftest import tiny_state_dict

pytestmark = pytest.mark.skipif(not cpu_decode.is_available(), reason="native CPU kernels unavailable")

BLOCK = 4


def _config(architecture: str = "llama", layers: int = 2) -> ModelConfig:
    # head_dim 64 and 3 query heads per KV head: shapes the native attention kernel takes, like SmolLM2's
    return ModelConfig(
        architecture=architecture,
        vocab_size=97,
        hidden_size=384,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        attention_bias=architecture == "qwen2",
        eos_token_ids=(2,),
    )


def _to_bf16(model):
    for module in model.modules():
        if isinstance(module, RuntimeLinear):
            module.set_compute_dtype(torch.bfloat16)
        else:
            for p in module.parameters(recurse=False):
                p.data = p.data.to(torch.bfloat16)
    return model


def _model(kind: str = "bf16", architecture: str = "llama"):
    cfg = _config(architecture)
    model = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.float32)
    if kind == "int8":
        compress(model, [RTNConfig(bits=8, group_size=None)], None, progress=False)
    elif kind in ("int8-g32", "int8-g16"):  # GGUF Q8_0's layout; Q6_K's groups of 16
        compress(model, [RTNConfig(bits=8, group_size=32)], None, progress=False)
        for name, module in list(model.named_modules()):
            if kind == "int8-g16" and isinstance(module, Int8WeightOnlyLinear):  # each scale on both halves
                halves = module.scales.repeat_interleave(2, dim=1)
                model.set_submodule(name, Int8WeightOnlyLinear(module.qweight, halves, module.bias, group_size=16))
    elif kind in ("int4", "int4-perm", "int4-a8", "int4-perm-a8"):
        compress(model, [RTNConfig(bits=4, group_size=64)], None, progress=False)
    elif kind in ("int8-a8", "int8-g32-a8"):
        compress(model, [RTNConfig(bits=8, group_size=None if kind == "int8-a8" else 32)], None, progress=False)
    elif kind == "w8a8":  # per-token int8 activations on the VNNI kernel at every row count
        compress(model, [RTNConfig(bits=8, group_size=None, act_bits=8)], None, progress=False)
    elif kind in ("sparse24", "sparse24-mixed"):  # every linear 2:4, or layer 0's MLP and layer 1's attention
        for i, layer in enumerate(model.model.layers):
            blocks = [layer.mlp, layer.self_attn] if kind == "sparse24" else [(layer.mlp, layer.self_attn)[i % 2]]
            for block in blocks:
                for name, linear in list(block.named_children()):
                    if name.endswith("proj"):
                        with torch.no_grad():
                            linear.weight.copy_(_prune_24(linear.weight))
                        setattr(block, name, to_sparse24(linear))
        if kind == "sparse24":
            assert sum(isinstance(m, Sparse24Linear) for m in model.modules()) == 14
    elif kind in ("bitmask", "bitmask-mixed"):  # 75% unstructured zeros in every linear, or in the MLPs only
        for layer in model.model.layers:
            for block in [layer.mlp, layer.self_attn] if kind == "bitmask" else [layer.mlp]:
                for name, linear in list(block.named_children()):
                    if name.endswith("proj"):
                        with torch.no_grad():
                            linear.weight.copy_(_prune_unstructured(linear.weight, 0.75))
                        setattr(block, name, to_bitmask(linear))
        if kind == "bitmask":
            assert sum(isinstance(m, BitmaskSparseLinear) for m in model.modules()) == 14
    elif kind in ("sparse24-int8", "sparse24-int4"):  # pruned 2:4, then quantized: the kept codes only
        bits, group = (8, None) if kind == "sparse24-int8" else (4, 64)
        compress(model, [MagnitudeConfig(pattern="2:4"), RTNConfig(bits=bits, group_size=group)], None, progress=False)
        assert sum(isinstance(m, (Sparse24Int8Linear, Sparse24Int4Linear)) for m in model.modules()) == 14
    elif kind == "act-sparse":  # 40% of every linear's inputs below its threshold, their weight rows skipped
        calib = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
        compress(model, [ActivationSparsityConfig(sparsity=0.4)], calib, progress=False)
    if kind in ("int4-perm", "int4-perm-a8"):  # act-order layers: stored columns are a permutation of the input's
        gen = torch.Generator().manual_seed(5)
        for module in model.modules():
            if isinstance(module, IntGroupWeightOnlyLinear):
                module.perm = torch.randperm(module.in_features, generator=gen)
    if kind.endswith("-a8"):  # int8 activations in groups of 32 (W4A8 / W8A8-dynamic) on gemm_a8
        assert resolve_activation_quant(model, "int8") == ("int8", 14)  # 7 linears a layer; the head stays bf16
    return _to_bf16(model)


def _prune_24(w: torch.Tensor) -> torch.Tensor:
    """The 2 largest |w| of every 4 consecutive input columns kept (magnitude 2:4 pruning)."""
    groups = w.reshape(w.shape[0], -1, 4)
    keep = groups.abs().topk(2, dim=-1).indices
    return torch.zeros_like(groups).scatter_(-1, keep, groups.gather(-1, keep)).reshape(w.shape)


def _prune_unstructured(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The smallest `sparsity` of |w| zeroed over the whole matrix (rows keep different counts), and row 3 all
    zero."""
    keep = w.abs() > w.abs().flatten().kthvalue(int(sparsity * w.numel())).values
    keep[3] = False
    return w * keep


def _cache(model, kv_dtype=torch.bfloat16, num_blocks: int = 64) -> PagedKVCache:
    cfg = model.config
    return PagedKVCache.allocate(
        cfg.num_hidden_layers, num_blocks, cfg.num_key_value_heads, BLOCK, cfg.head_dim, kv_dtype, "cpu"
    )


def _decode(
    model,
    native: bool,
    batch: int,
    steps: int = 5,
    seed: int = 3,
    kv_dtype=torch.bfloat16,
    cache: PagedKVCache | None = None,
    routing: ExpertRouting = ExpertRouting(),
) -> torch.Tensor:
    """Prefill `batch` prompts one by one (PyTorch path), then decode them together under `routing`: hidden
    [steps, B, hidden]."""
    cache = cache if cache is not None else _cache(model, kv_dtype, num_blocks=max(64, 16 * batch))
    assert model.native_decode_plan().accepts(cache)
    model.allow_native_decode = native
    cfg, gen = model.config, torch.Generator().manual_seed(seed)
    blocks = [list(range(16 * b, 16 * b + 16)) for b in range(batch)]
    lens = [7 + 2 * b for b in range(batch)]
    for b in range(batch):
        ids = torch.randint(0, cfg.vocab_size, (lens[b],), generator=gen)
        ctx = build_forward_context([lens[b]], [lens[b]], [blocks[b][: math.ceil(lens[b] / BLOCK)]], cache)
        with forward_context(ctx):
            model(ids, torch.arange(lens[b]))
    out = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
        tables = [blocks[b][: math.ceil((lens[b] + 1) / BLOCK)] for b in range(batch)]
        ctx = build_forward_context([1] * batch, [n + 1 for n in lens], tables, cache, routing=routing)
        with forward_context(ctx):
            out.append(model(ids, torch.tensor(lens)))
        lens = [n + 1 for n in lens]
    model.allow_native_decode = True
    return torch.stack(out)


KINDS = [
    "bf16",
    "int8",
    "int8-g32",
    "int8-g16",
    "int4",
    "int4-perm",
    "w8a8",
    "int4-a8",
    "int4-perm-a8",
    "int8-a8",
    "int8-g32-a8",
    "sparse24",
    "sparse24-mixed",
    "sparse24-int8",
    "sparse24-int4",
    "bitmask",
    "bitmask-mixed",
    "act-sparse",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3, 12])
def test_native_loop_is_bit_identical_to_the_pytorch_path(kind, architecture, batch):
    if (kind == "w8a8" or kind.endswith("-a8")) and not cpu_w8a8.is_available():
        pytest.skip("the CPU lacks AVX512-VNNI")
    if kind.startswith("sparse24") and not (cpu_sparse.is_available() and cpu_sparse.quant_is_available()):
        pytest.skip(f"CPU 2:4 sparse kernel: {cpu_sparse.unavailable_reason()}")
    if kind.startswith("bitmask") and not cpu_bitmask.is_available():
        pytest.skip(f"CPU bitmask sparse kernel: {cpu_bitmask.unavailable_reason()}")
    model = _model(kind, architecture)
    with activation_quant("int8" if kind.endswith("-a8") else "none"):  # as the engine runs each step
        _check_native_loop(model, kind, batch)


def _check_native_loop(model, kind: str, batch: int) -> None:
    native = _decode(model, native=True, batch=batch)
    reference = _decode(model, native=False, batch=batch)
    assert native.abs().max() > 0
    assert torch.equal(native, reference)
    if kind.startswith("sparse24"):  # the loop ran the sparse kernel, next to bf16 linears when mixed
        kinds = {linear.name for layer in model.native_decode_plan().loop._keep[0] for linear in layer.linears}
        expected = {
            "sparse24": {"sparse24"},
            "sparse24-mixed": {"sparse24", "bf16"},
            "sparse24-int8": {"sparse24_int8"},
            "sparse24-int4": {"sparse24_int4"},
        }
        assert kinds == expected[kind]
    if kind.endswith("-a8"):  # every decoder linear ran gemm_a8
        kinds = {linear.name for layer in model.native_decode_plan().loop._keep[0] for linear in layer.linears}
        assert kinds == {"a8"}
    if kind.startswith("bitmask"):  # the loop ran the bitmask kernel, next to bf16 linears when mixed
        kinds = {linear.name for layer in model.native_decode_plan().loop._keep[0] for linear in layer.linears}
        assert kinds == {"bitmask"} | ({"bf16"} if kind == "bitmask-mixed" else set())
    if kind == "act-sparse":  # the loop ran the skipping kernel; 9+ rows stay on PyTorch (no dense GEMM for them)
        kinds = {linear.name for layer in model.native_decode_plan().loop._keep[0] for linear in layer.linears}
        assert kinds == {"act_sparse"} and model.native_decode_plan().batched_loop is None
        return
    # 9+ rows ran on the loop over packed weights (built at the first such step), fewer never built it
    assert (model.native_decode_plan().batched_loop is not None) == (batch > cpu_decode.MAX_ROWS)


@pytest.mark.parametrize("batch", [1, 12])
def test_sparse_layers_without_the_sparse_kernel_run_their_dense_copies_in_the_loop(batch, monkeypatch):
    """A CPU with AVX512-BF16 but no VBMI2 (Cooper Lake): the loop takes 2:4 layers as their widened bf16 weights,
    and gives the same numbers (the sparse kernel equals the bf16 one on the dense weight)."""
    model = _model("sparse24-mixed")
    expected = _decode(model, native=True, batch=batch) if cpu_sparse.is_available() else None
    missing = NativeKernel(cpu_sparse._KERNEL.source, "unused", [], None, cpu_needs=("avx512_bf16", "no_such_flag"))
    monkeypatch.setattr(cpu_sparse, "_KERNEL", missing)
    model = _model("sparse24-mixed")  # a fresh plan: the loop is built without the sparse kernel
    plan = model.native_decode_plan()
    assert plan.loop is not None
    linears = [linear for layer in plan.loop._keep[0] for linear in layer.linears]
    assert {linear.name for linear in linears} == {"bf16"}
    native = _decode(model, native=True, batch=batch)
    assert torch.equal(native, _decode(model, native=False, batch=batch))
    assert expected is None or torch.equal(native, expected)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_24_layers_without_their_kernels_run_their_dense_codes_in_the_loop(bits, monkeypatch):
    """No VBMI2: the loop takes 2:4 int8 / int4 layers as dense int8 / int4 layers of the widened codes (the
    same weights, so the same answers to the kernels' rounding) and matches the PyTorch path bit for bit."""
    kind = f"sparse24-int{bits}"
    expected = _decode(_model(kind), native=True, batch=1) if cpu_sparse.quant_is_available() else None
    for name in ("_INT8_KERNEL", "_INT4_KERNEL"):
        source = getattr(cpu_sparse, name).source
        monkeypatch.setattr(cpu_sparse, name, NativeKernel(source, "unused", [], None, cpu_needs=("no_such_flag",)))
    model = _model(kind)
    plan = model.native_decode_plan()
    linears = [linear for layer in plan.loop._keep[0] for linear in layer.linears]
    assert {linear.name for linear in linears} == {"int8" if bits == 8 else "int4"}
    native = _decode(model, native=True, batch=1)
    assert torch.equal(native, _decode(model, native=False, batch=1))
    if expected is not None:  # different kernels, same weights: equal to bf16 rounding of the hidden states
        assert (native.float() - expected.float()).abs().max() <= 0.05 * expected.float().abs().max()


@pytest.mark.parametrize("batch", [1, 12])
def test_bitmask_layers_without_their_kernel_run_their_dense_copies_in_the_loop(batch, monkeypatch):
    """No VBMI2: the loop takes bitmask layers as their widened bf16 weights, with the same numbers."""
    model = _model("bitmask-mixed")
    expected = _decode(model, native=True, batch=batch) if cpu_bitmask.is_available() else None
    missing = NativeKernel(cpu_bitmask._KERNEL.source, "unused", [], None, cpu_needs=("avx512_bf16", "no_such_flag"))
    monkeypatch.setattr(cpu_bitmask, "_KERNEL", missing)
    model = _model("bitmask-mixed")  # a fresh plan: the loop is built without the bitmask kernel
    plan = model.native_decode_plan()
    assert plan.loop is not None
    assert {linear.name for layer in plan.loop._keep[0] for linear in layer.linears} == {"bf16"}
    native = _decode(model, native=True, batch=batch)
    assert torch.equal(native, _decode(model, native=False, batch=batch))
    assert expected is None or torch.equal(native, expected)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [3, 12])
def test_int8_kv_cache_is_bit_identical_too(architecture, batch):
    model = _model("int4", architecture)
    native = _decode(model, native=True, batch=batch, kv_dtype=torch.int8)
    assert torch.equal(native, _decode(model, native=False, batch=batch, kv_dtype=torch.int8))


def test_batched_rows_do_not_depend_on_the_thread_count():
    model = _model("int4")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _decode(model, native=True, batch=12)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, _decode(model, native=True, batch=12))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_cache_contents_match_too(kv_dtype):
    model = _model("int4")
    caches = [_cache(model, kv_dtype) for _ in range(2)]
    _decode(model, native=True, batch=2, cache=caches[0])
    _decode(model, native=False, batch=2, cache=caches[1])
    assert torch.equal(caches[0].kv.view(torch.uint8), caches[1].kv.view(torch.uint8))
    assert (caches[0].scales is None) == (kv_dtype == torch.bfloat16)
    assert caches[0].scales is None or torch.equal(caches[0].scales, caches[1].scales)


def test_steps_aside_where_it_has_no_path():
    model = _model("bf16")
    plan = model.native_decode_plan()
    assert plan.loop is not None and not plan.accepts(_cache(model, torch.float8_e4m3fn))  # quantized on write
    model = _model("bf16")
    compress(model, [RTNConfig(bits=8, act_bits=8, group_size=64)], None, progress=False)  # ZeroQuant: no kernel
    assert model.native_decode_plan().loop is None
    cfg = dataclasses.replace(_config(), num_attention_heads=4, head_dim=80)  # not a multiple of 32
    assert build_model(cfg, tiny_state_dict(cfg), torch.bfloat16).native_decode_plan().loop is None
    model = build_model(_config(), tiny_state_dict(_config()), torch.bfloat16, attention_backend="torch")
    assert model.native_decode_plan().loop is None  # a user's backend choice is kept
    model = build_model(_config(), tiny_state_dict(_config()), torch.float32)
    assert model.native_decode_plan().loop is None


def test_plan_is_rebuilt_when_the_weights_change():
    model = _model("bf16")
    before = model.native_decode_plan()
    assert model.native_decode_plan() is before  # nothing changed: the same loop
    model.float()  # a dtype cast swaps every parameter's storage
    assert not before.is_current()
    compress(model, [RTNConfig(bits=8, group_size=None)], None, progress=False)
    _to_bf16(model)
    after = model.native_decode_plan()
    assert after is not before and after.loop is not None
    assert torch.equal(_decode(model, native=True, batch=2), _decode(model, native=False, batch=2))
    with torch.no_grad():
        model.model.norm.weight.mul_(2)  # an in-place edit bumps the version: rebuilt, and the new numbers used
    assert not after.is_current()
    assert torch.equal(_decode(model, native=True, batch=2), _decode(model, native=False, batch=2))


def test_a_cast_round_trip_reads_the_new_storage():
    """The hazard a hand-refreshed loop had: cast away and back, and the old pointers would read freed memory."""
    model = _model("bf16")
    reference = _decode(model, native=False, batch=2)
    _to_bf16(model.float())  # (not .bfloat16(): the rotary table stays float32)
    assert torch.equal(_decode(model, native=True, batch=2), reference)


def test_wrong_inputs_are_refused_with_a_message():
    model = _model("bf16")
    plan, cache = model.native_decode_plan(), _cache(model)  # the loop points into the cache: keep it alive
    assert plan.accepts(cache)
    loop = plan.loop
    x = torch.zeros(9, 384, dtype=torch.bfloat16)
    idx = torch.zeros(9, dtype=torch.long)
    with pytest.raises(ValueError, match="1-8"):  # the loop on the linears' own weights; 9+ rows have another
        loop(x, idx, idx, torch.zeros(9, 1, dtype=torch.long), idx, 1)
    with pytest.raises(ValueError, match="int64"):
        loop(x[:1], idx[:1].int(), idx[:1], torch.zeros(1, 1, dtype=torch.long), idx[:1], 1)
    with pytest.raises(RuntimeError, match="positions"):  # past the rotary table
        loop(x[:1].clone(), torch.tensor([10_000]), idx[:1], torch.zeros(1, 1, dtype=torch.long), idx[:1] + 1, 1)


def test_row_helpers_match_float_references():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 576, generator=gen) * 3).to(torch.bfloat16)
    x[0, 7] = 300.0  # a massive activation
    w = torch.randn(576, generator=gen).to(torch.bfloat16)
    xf = x.double()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    got = cpu_rows.rms_norm(x, w, 1e-5).double()
    assert ((got - ref).abs() <= ref.abs() * 2**-8 + 1e-30).all()  # within one bf16 rounding
    gate, up = x, (torch.randn(5, 576, generator=gen)).to(torch.bfloat16)
    silu = (gate.double() * torch.sigmoid(gate.double())).to(torch.bfloat16).double()
    ref = silu * up.double()
    got = cpu_rows.silu_and_mul(gate, up).double()
    assert ((got - ref).abs() <= ref.abs() * 2**-8 + 1e-30).all()
    with pytest.raises(ValueError, match="bf16"):
        cpu_rows.rms_norm(x.float(), w, 1e-5)
    edges = torch.tensor([-1e30, -100.0, -88.0, -1e-30, 0.0, 1e-30, 88.0, 100.0, 1e30, float("inf")])
    got = cpu_rows.silu_and_mul(edges.to(torch.bfloat16)[None], torch.ones(1, 10, dtype=torch.bfloat16))
    assert torch.equal(got[0].float(), torch.nn.functional.silu(edges.double()).to(torch.bfloat16).float())
    nan = torch.full((1, 3), float("nan"), dtype=torch.bfloat16)
    assert cpu_rows.silu_and_mul(nan, torch.ones_like(nan)).isnan().all()
    with pytest.raises(ValueError, match="one shape"):
        cpu_rows.silu_and_mul(gate, up[:, :8].contiguous())


def test_row_helpers_give_each_row_the_same_bits_in_any_batch():
    """Rows of an odd width (vector tails) alone, in a batch of 37, and on one thread: identical."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 100, generator=gen) * 2).to(torch.bfloat16)
    up = torch.randn(37, 100, generator=gen).to(torch.bfloat16)
    w = torch.randn(100, generator=gen).to(torch.bfloat16)
    norm, act = cpu_rows.rms_norm(x, w, 1e-6), cpu_rows.silu_and_mul(x, up)
    assert torch.equal(cpu_rows.rms_norm(x[5:6], w, 1e-6), norm[5:6])
    assert torch.equal(cpu_rows.silu_and_mul(x[30:], up[30:]), act[30:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_rows.rms_norm(x, w, 1e-6), norm)
        assert torch.equal(cpu_rows.silu_and_mul(x, up), act)
    finally:
        torch.set_num_threads(threads)


def test_smollm2_greedy_output_is_unchanged(smollm_path):
    from leanlm.llm import LLM
    from leanlm.sampling_params import SamplingParams

    llm = LLM(str(smollm_path), dtype="bfloat16", progress=False)
    model = llm.llm_engine.model
    assert model.native_decode_plan().accepts(llm.llm_engine.model_runner.kv_cache)
    prompts = ["The history of the Roman Empire", "def fibonacci(n):", "Paris is the capital of"]
    prompts += [f"{p} ({i})" for i in range(3) for p in prompts]  # 12 rows: the loop over packed weights too
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert model.native_decode_plan().batched_loop is not None
    model.allow_native_decode = False
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert native == reference


def test_argmax_matches_torch_on_bf16_rows():
    """The sampler's greedy argmax over bf16 logits: torch's indices on random rows of every tail length, on ties
    (the first wins, +0 equals -0), infinities, and NaNs of either sign (a NaN counts as the largest)."""
    gen = torch.Generator().manual_seed(0)
    for rows, width in [(128, 49152), (3, 33), (1, 5), (7, 64), (2, 1)]:
        x = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
        assert torch.equal(cpu_rows.argmax(x), x.argmax(dim=-1))
    inf, nan = float("inf"), float("nan")
    special = [[0.0, -0.0, -1.0], [-0.0, 0.0, -1.0], [1.0, 1.0, 0.0], [-3.0, -2.0, -2.0], [-inf, -inf, -inf]]
    special += [[1.0, nan, nan], [inf, 2.0, inf], [-0.0, -0.0, -5.0], [-nan, 1.0, nan]]
    x = torch.tensor(special).to(torch.bfloat16)
    assert cpu_rows.argmax(x).tolist() == x.argmax(dim=-1).tolist()
    long_rows = torch.full((3, 100), -7.0).to(torch.bfloat16)  # past the vector loop, and in its tail
    long_rows[0, 77], long_rows[1, 3], long_rows[2, 97] = nan, -nan, 5.0
    assert cpu_rows.argmax(long_rows).tolist() == [77, 3, 97] == long_rows.argmax(dim=-1).tolist()
    assert torch.equal(cpu_rows.argmax(x.float()), x.float().argmax(dim=-1))  # other dtypes: torch's own


MOE_CASES = {
    "top2-renorm": MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=128),
    "top1-shared": MoEConfig(
        num_experts=3, top_k=1, expert_intermediate_size=128, scoring="softmax", shared_expert_intermediate_size=256
    ),  # fmt: skip
    "ones-top3": MoEConfig(num_experts=4, top_k=3, expert_intermediate_size=128, scoring="ones"),
}


def _moe_model(moe: MoEConfig, kind: str = "bf16"):
    cfg = dataclasses.replace(_config(), moe=moe)
    model = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.float32)
    if kind == "int4":
        compress(model, [RTNConfig(bits=4, group_size=64)], progress=False)
    return _to_bf16(model)


@pytest.mark.parametrize("case", list(MOE_CASES))
@pytest.mark.parametrize("kind", ["bf16", "int4"])
@pytest.mark.parametrize("batch", [1, 5, 12])
def test_moe_layers_in_the_native_loop_are_bit_identical_to_the_pytorch_path(case, kind, batch):
    model = _moe_model(MOE_CASES[case], kind)
    native = _decode(model, native=True, batch=batch)
    reads = [b.stats.native.clone() for b in moe_blocks(model)]
    reference = _decode(model, native=False, batch=batch)
    assert native.abs().max() > 0 and torch.equal(native, reference)
    assert all(int(r[:-2].sum()) == 5 * batch * MOE_CASES[case].top_k for r in reads)  # the loop counted its routing
    assert model.native_decode_plan().loop is not None


def test_moe_capacity_and_gated_shared_experts_stay_on_pytorch():
    model = _moe_model(MOE_CASES["top2-renorm"])
    _decode(model, native=True, batch=2, routing=ExpertRouting(RoutingPolicy(capacity_factor=1.0)))
    assert all(int(b.stats.native.sum()) == 0 for b in moe_blocks(model))  # the plan stepped aside
    gated = dataclasses.replace(MOE_CASES["top1-shared"], shared_expert_gate=True)
    assert _moe_model(gated).native_decode_plan().loop is None
