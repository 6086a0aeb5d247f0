"""Sparse prefill on a GPU through PyTorch: the attention patterns' flex_attention path against dense causal SDPA
(flash attention) and against the chunked SDPA path, at SmolLM2-135M's attention shapes, and whole-model prefills.

Weights are random at SmolLM2-135M-Instruct's shape (bf16): the bundled GGUF does not travel to the GPU machine,
and speed does not depend on the values (quality is measured on the real model on CPU: benchmarks/long_context.py).
Times are CUDA-event medians of --reps calls after warm-up (compilation excluded).
Command: python benchmarks/long_context_gpu.py --out docs/long-context.md
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from leanlm.analysis.markdown import replace_section
from leanlm.config import ModelConfig
from leanlm.config.long_context import LongContextConfig
from leanlm.model.attention_pattern import AttentionPattern, StepPatterns
from leanlm.model.context import build_forward_context, forward_context
from leanlm.model.llama import LlamaForCausalLM, build_model
from leanlm.model.paged_kv import LayerKV, PagedKVCache
from leanlm.model.sparse_attention import sparse_attention

H, HKV, D, BLOCK = 9, 3, 64, 16
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself, timed by the wall clock
SMOLLM2 = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)  # fmt: skip
PATTERNS = {
    "local+global (1024 + 64)": AttentionPattern(1024, sinks=64),
    "strided (1024)": AttentionPattern(1024, stride=1024),
    "window 1024": AttentionPattern(1024),
}


def cuda_time(fn, reps: int) -> float:
    """Median seconds of fn() over reps calls, after three warm-up calls."""
    for _ in range(3):
        fn()
    if DEVICE == "cpu":
        return statistics.median(_wall(fn) for _ in range(reps))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _wall(fn) -> float:
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def layer_cache(n: int, gen: torch.Generator) -> tuple[LayerKV, torch.Tensor]:
    blocks = -(-n // BLOCK)
    k = torch.randn(blocks, HKV, BLOCK, D, generator=gen).bfloat16().to(DEVICE)
    v = torch.randn(blocks, HKV, BLOCK, D, generator=gen).bfloat16().to(DEVICE)
    return LayerKV(k, v, None, None), torch.arange(blocks, device=DEVICE)


def attention_table(lengths: list[int], reps: int) -> str:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lengths:
        kv, blocks = layer_cache(n, gen)
        q = torch.randn(n, H, D, generator=gen).bfloat16().to(DEVICE)
        keys = kv.k_cache.transpose(1, 2).reshape(-1, HKV, D)[:n].transpose(0, 1)[None]
        values = kv.v_cache.transpose(1, 2).reshape(-1, HKV, D)[:n].transpose(0, 1)[None]
        queries = q.transpose(0, 1)[None]

        def dense():
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=D**-0.5, enable_gqa=True)

        base = cuda_time(dense, reps)
        rows.append(f"| {n} | dense causal SDPA (flash) | {base * 1e3:.3f} | 1.00x | - |")
        for name, pattern in PATTERNS.items():
            flex = sparse_attention(q, None, kv, blocks, n, D**-0.5, pattern, use_flex=True)
            chunked = sparse_attention(q, None, kv, blocks, n, D**-0.5, pattern, use_flex=False)
            err = (flex.float() - chunked.float()).abs().max().item()
            t_flex = cuda_time(
                lambda p=pattern: sparse_attention(q, None, kv, blocks, n, D**-0.5, p, use_flex=True), reps
            )
            t_chunk = cuda_time(
                lambda p=pattern: sparse_attention(q, None, kv, blocks, n, D**-0.5, p, use_flex=False), reps
            )
            rows.append(f"| {n} | {name}, flex_attention | {t_flex * 1e3:.3f} | {base / t_flex:.2f}x | {err:.1e} |")
            rows.append(f"| {n} | {name}, chunked SDPA | {t_chunk * 1e3:.3f} | {base / t_chunk:.2f}x | - |")
        print("\n".join(rows[-7:]), flush=True)
    head = ("| prefill tokens | attention of one layer (9 heads, 3 KV heads, D 64) | ms | speed-up over dense | "
            "max abs difference flex vs chunked |\n|---|---|---|---|---|\n")  # fmt: skip
    return head + "\n".join(rows) + "\n"


def random_model() -> LlamaForCausalLM:
    config = ModelConfig(**SMOLLM2)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items() if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(0)
    state = {
        name: (1 + 0.1 * torch.randn(shape, generator=gen))
        if name.endswith("norm.weight")
        else torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        for name, shape in shapes.items()
    }
    return build_model(config, state, torch.bfloat16, device=DEVICE)


def model_table(model: LlamaForCausalLM, lengths: list[int], reps: int) -> str:
    cfg = model.config
    rows = []
    for n in lengths:
        model.rotary_emb.ensure(n)
        cache = PagedKVCache.allocate(cfg.num_hidden_layers, -(-n // BLOCK), HKV, BLOCK, D, torch.bfloat16, DEVICE)
        ids = torch.randint(0, cfg.vocab_size, (n,), device=DEVICE)
        positions = torch.arange(n, device=DEVICE)
        base = None
        for name, options in (("dense", {}), ("local+global (1024 + 64)", {"prefill_attention": "local-global"}),
                              ("strided (1024)", {"prefill_attention": "strided"})):  # fmt: skip
            patterns = StepPatterns.of(LongContextConfig(**options))
            ctx = build_forward_context([n], [n], [list(range(-(-n // BLOCK)))], cache, patterns)

            def run(ctx=ctx):
                with forward_context(ctx), torch.no_grad():
                    model(ids, positions)

            t = cuda_time(run, reps)
            base = base or t
            rows.append(f"| {n} | {name} | {t * 1e3:.1f} | {base / t:.2f}x | {n / t:,.0f} |")
            print(rows[-1], flush=True)
    head = ("| prompt tokens | prefill attention | whole forward ms (30 layers) | speed-up | tokens/s |\n"
            "|---|---|---|---|---|\n")  # fmt: skip
    return head + "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--model-lengths", default="8192,32768")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    text = (
        f"{gpu}, torch {torch.__version__}. Weights random at SmolLM2-135M's shape, bf16; CUDA-event medians of "
        f"{args.reps} calls after warm-up.\n\n"
        + attention_table([int(x) for x in args.lengths.split(",")], args.reps)
        + "\n"
        + model_table(random_model(), [int(x) for x in args.model_lengths.split(",")], args.reps)
    )
    print(text)
    if args.out:
        replace_section(Path(args.out), "gpu", "## Measured: sparse prefill on a GPU\n\n" + text)


if __name__ == "__main__":
    main()
