"""MHA -> GQA / MQA conversion before uptraining (Ainslie et al. 2023): WikiText-2 perplexity and KL divergence
against the float model of each way to build the fewer K/V heads (mean-pool each group, keep its first head,
random), in one run. Uptraining is `leanlm train --kv-heads N --kv-init I` (docs/training.md).

    python benchmarks/gqa.py --model smollm2-135m-instruct --doc docs/training.md

The same protocol as benchmarks/quantization.py (whose machinery this reuses): each conversion is made from the
float32 model, saved, loaded back through `LLM(dir)` and scored in bfloat16. It needs no calibration.
"""

from __future__ import annotations

from quantization import Study, main  # benchmarks/

from leanlm.compress import GQAConfig

# name -> GQAConfig fields
CONFIGS: dict[str, dict] = {
    "MQA (1 K/V head) mean-pool": dict(num_key_value_heads=1, init="mean"),
    "MQA (1 K/V head) first head": dict(num_key_value_heads=1, init="first"),
    "MQA (1 K/V head) random": dict(num_key_value_heads=1, init="random"),
}

GQA = Study(CONFIGS, lambda opts: [GQAConfig(**opts)], "benchmarks/gqa.py", "bench-results/gqa", "Converted", "s")

if __name__ == "__main__":
    main(GQA, __doc__)
