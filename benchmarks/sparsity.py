"""Pruning quality in one run: every method's WikiText-2 perplexity and KL divergence against the float
model, on one model, calibrated on other text (gensim's Wikipedia articles).

    python benchmarks/sparsity.py --model smollm2-135m-instruct --doc docs/sparsity.md

The same protocol as benchmarks/quantization.py (whose machinery this reuses): each configuration is pruned
(and maybe quantized) from the float32 model, saved, loaded back through `LLM(dir)` and scored in bfloat16.
"""

from __future__ import annotations

from quantization import Study, main  # benchmarks/

from leanlm.compress.named_recipes import build_prune_recipe

# name -> options of build_prune_recipe (the `leanlm prune` flags)
CONFIGS: dict[str, dict] = {
    "50% magnitude (per layer)": dict(method="magnitude", sparsity=0.5),
    "50% magnitude (global)": dict(method="magnitude", sparsity=0.5, scope="global"),
    "50% Wanda": dict(method="wanda", sparsity=0.5),
    "50% SparseGPT": dict(method="sparsegpt", sparsity=0.5),
    "2:4 magnitude": dict(method="magnitude", pattern="2:4"),
    "2:4 Wanda": dict(method="wanda", pattern="2:4"),
    "2:4 SparseGPT": dict(method="sparsegpt", pattern="2:4"),
    "2:4 magnitude permuted": dict(method="magnitude", pattern="2:4", permute=True),
    "2:4 Wanda permuted": dict(method="wanda", pattern="2:4", permute=True),
    "2:4 SparseGPT permuted": dict(method="sparsegpt", pattern="2:4", permute=True),
    "4:8 Wanda": dict(method="wanda", pattern="4:8"),
    "4:8 SparseGPT": dict(method="sparsegpt", pattern="4:8"),
    "2:4 SparseGPT then GPTQ W4 g64": dict(method="sparsegpt", pattern="2:4", then_quantize="gptq", bits=4),
    "2:4 SparseGPT joint W4 g64": dict(method="sparsegpt", pattern="2:4", joint=True, bits=4),
    "60% Wanda": dict(method="wanda", sparsity=0.6),
    "60% SparseGPT": dict(method="sparsegpt", sparsity=0.6),
    "70% SparseGPT": dict(method="sparsegpt", sparsity=0.7),
    # OWL: the same sparsity spread over the layers by their outlier ratios
    "50% Wanda OWL": dict(method="wanda", sparsity=0.5, profile="owl"),
    "50% SparseGPT OWL": dict(method="sparsegpt", sparsity=0.5, profile="owl"),
    "60% Wanda OWL": dict(method="wanda", sparsity=0.6, profile="owl"),
    "60% SparseGPT OWL": dict(method="sparsegpt", sparsity=0.6, profile="owl"),
    "70% Wanda": dict(method="wanda", sparsity=0.7),
    "70% Wanda OWL": dict(method="wanda", sparsity=0.7, profile="owl"),
    "70% SparseGPT OWL": dict(method="sparsegpt", sparsity=0.7, profile="owl"),
}

SPARSITY = Study(
    CONFIGS,
    lambda opts: build_prune_recipe(**opts),
    "benchmarks/sparsity.py",
    "bench-results/sparsity",
    "Pruned",
    "prune s",
)

if __name__ == "__main__":
    main(SPARSITY, __doc__)
