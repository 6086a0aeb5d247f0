"""2:4 sparse products on an NVIDIA GPU's sparse tensor cores against cuBLAS on the dense weight, per decoder layer
of real model shapes (q, k, v, o, gate, up, down), by the number of token rows [M]. This is what sets
`leanlm.model.linear.tensor_cores.MIN_MACS`, the product size from which Sparse24Linear's CUDA rows take the sparse
tensor cores.

Each row times one decoder layer's seven products as Sparse24Linear's CUDA path makes them (F.linear on PyTorch's
semi-structured tensor, eager: its dispatch is part of the cost a model pays), with CUDA events over --iters calls
after warm-up, in bf16, on random 2:4 weights (the speed does not depend on the values). Needs CUDA (compute
capability 8.0+).

    python benchmarks/gpu_sparse24.py --out docs/sparsity.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from leanlm.analysis.markdown import replace_section
from leanlm.model.linear import tensor_cores

# (name, hidden, kv width, intermediate): the decoder-layer shapes of the models we run, and a 7-8B one.
MODELS = [
    ("SmolLM2-135M", 576, 192, 1536),
    ("Qwen2.5-0.5B", 896, 128, 4864),
    ("Qwen2.5-1.5B", 1536, 256, 8960),
    ("Llama-3-8B", 4096, 1024, 14336),
]
ROWS = [1, 16, 64, 256, 1024, 4096, 16384]


def layer_shapes(hidden: int, kv: int, ffn: int) -> list[tuple[int, int]]:
    """(out, in) of q, k, v, o, gate, up, down."""
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden), (hidden, ffn)]


def random_24(n: int, k: int) -> torch.Tensor:
    """A bf16 CUDA weight [N, K] with 2 random nonzeros in every 4 columns."""
    w = torch.randn(n, k // 4, 4, device="cuda")
    keep = torch.rand(n, k // 4, 4, device="cuda").argsort(-1) < 2
    return (w * keep).reshape(n, k).bfloat16() / k**0.5


def time_us(fn, iters: int) -> float:
    """Mean microseconds per call over iters calls (after 10 warm-up calls), by CUDA events."""
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def measure(hidden: int, kv: int, ffn: int, rows: int, iters: int) -> dict[str, float]:
    """Microseconds for one layer's seven products: dense cuBLAS, and each semi-structured backend."""
    dense = [random_24(n, k) for n, k in layer_shapes(hidden, kv, ffn)]
    backends = {"cuSPARSELt": torch.sparse.SparseSemiStructuredTensorCUSPARSELT}
    backends["CUTLASS"] = torch.sparse.SparseSemiStructuredTensorCUTLASS
    if not torch.backends.cusparselt.is_available():
        del backends["cuSPARSELt"]
    if torch.cuda.get_device_capability()[0] != 8:  # PyTorch's CUTLASS 2:4 kernels are built for 8.x only
        del backends["CUTLASS"]
    xs = {k: torch.randn(rows, k, device="cuda").bfloat16() for k in {hidden, ffn}}
    result = {"cuBLAS dense": time_us(lambda: [F.linear(xs[w.shape[1]], w) for w in dense], iters)}
    for name, cls in backends.items():
        sparse = [tensor_cores.compress(w, cls) for w in dense]
        err = max(
            float((F.linear(xs[w.shape[1]], s) - F.linear(xs[w.shape[1]], w)).abs().max())
            for w, s in zip(dense, sparse)
        )
        assert err < 0.5, f"{name} disagrees with the dense product by {err}"
        result[name] = time_us(lambda sparse=sparse: [F.linear(xs[s.shape[1]], s) for s in sparse], iters)
    return result


def table(iters: int) -> str:
    props = torch.cuda.get_device_properties(0)
    head = (
        f"GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, cuSPARSELt "
        f"{'yes' if torch.backends.cusparselt.is_available() else 'no'}; bf16, one decoder layer's seven products "
        f"(q, k, v, o, gate, up, down), eager, mean of {iters} calls by CUDA events. Command: "
        f"`python benchmarks/gpu_sparse24.py --out docs/sparsity.md`.\n\n"
    )
    lines = [
        "| model | rows | cuBLAS dense us | cuSPARSELt us | CUTLASS us | best 2:4 vs dense |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, hidden, kv, ffn in MODELS:
        for rows in ROWS:
            r = measure(hidden, kv, ffn, rows, iters)
            sparse = [v for k, v in r.items() if k != "cuBLAS dense"]
            cells = [f"{r[k]:.1f}" if k in r else "-" for k in ("cuBLAS dense", "cuSPARSELt", "CUTLASS")]
            lines.append(f"| {name} | {rows} | {' | '.join(cells)} | {r['cuBLAS dense'] / min(sparse):.2f}x |")
            print(lines[-1], flush=True)
    return head + "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path, default=None, help="markdown file whose section sparse-gpu is rewritten")
    args = p.parse_args()
    if not (torch.cuda.is_available() and tensor_cores.is_available(torch.device("cuda"))):
        raise SystemExit("needs a CUDA GPU with sparse tensor cores (compute capability 8.0+)")
    text = table(args.iters)
    print(text)
    if args.out is not None:
        replace_section(args.out, "sparse-gpu", text)


if __name__ == "__main__":
    main()
