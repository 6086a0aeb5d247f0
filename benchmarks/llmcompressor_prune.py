"""The same one-shot prune through llm-compressor (the reference implementation of SparseGPT and Wanda that
vLLM users run), on LeanLM's exact float32 weights and calibration token ids, for `leanlm eval ppl` to score.

Step 1, in LeanLM's venv: write the dense float32 model as an HF directory and the calibration ids
(benchmarks/sparsity.py's: 64 x 256 tokens of gensim's Wikipedia articles):

    python benchmarks/llmcompressor_prune.py export --model smollm2-135m-instruct --out DIR

Step 2, in a venv of its own (`pip install torch==2.13.0 llmcompressor`; it pins its own transformers):

    python benchmarks/llmcompressor_prune.py prune --dense DIR --method sparsegpt --sparsity 0.5 --out OUT

Step 3, in LeanLM's venv: `leanlm eval ppl --model OUT --dtype bfloat16 --seq-len 2048 --max-windows 8`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from leanlm.formats.checkpoint import Checkpoint


def export(model: str, out: Path, num_samples: int, seq_len: int) -> None:
    import torch
    from safetensors.torch import save_file

    from leanlm.compress import calibration_samples, read_calibration_text
    from leanlm.formats import save_checkpoint
    from leanlm.formats.stored import read_checkpoint
    from leanlm.model.llama import build_model

    ckpt = read_checkpoint(model, progress=False)
    dense = build_model(ckpt.config, ckpt.state_dict, torch.float32)
    save_checkpoint(
        Checkpoint(dense, ckpt.tokenizer), out
    )  # config and tokenizer; the weights are rewritten in float32
    tied = ckpt.config.tie_word_embeddings
    weights = {k: v.float().contiguous() for k, v in dense.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "quantization_config.json").unlink(missing_ok=True)
    ids = ckpt.tokenizer.encode(read_calibration_text(), add_special_tokens=False)
    torch.save(calibration_samples(ids, num_samples, seq_len), out / "calibration_ids.pt")
    print(f"wrote {out}: float32 weights and calibration ids [{num_samples}, {seq_len}]")


def prune(dense: Path, method: str, sparsity: float, pattern: str, out: Path) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.load(dense / "calibration_ids.pt")
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    options = dict(sparsity=sparsity, mask_structure=pattern, targets=["Linear"], ignore=["lm_head"])
    modifier = SparseGPTModifier(**options) if method == "sparsegpt" else WandaPruningModifier(**options)
    start = time.perf_counter()
    oneshot(
        model=model,
        dataset=data,
        recipe=[modifier],
        num_calibration_samples=ids.shape[0],
        max_seq_length=ids.shape[1],
        shuffle_calibration_samples=False,
    )
    print(f"{method} pruned in {time.perf_counter() - start:.0f} s")
    model.save_pretrained(out, save_compressed=False)
    AutoTokenizer.from_pretrained(dense).save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)
    e = sub.add_parser("export", help="LeanLM's venv: dense float32 HF directory + calibration ids")
    e.add_argument("--model", default="smollm2-135m-instruct")
    e.add_argument("--num-samples", type=int, default=64)
    e.add_argument("--seq-len", type=int, default=256)
    e.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("prune", help="llm-compressor's venv: one-shot prune of the exported model")
    p.add_argument("--dense", type=Path, required=True)
    p.add_argument("--method", choices=("sparsegpt", "wanda"), required=True)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--pattern", default="0:0", help="llm-compressor's mask_structure: 0:0 unstructured, 2:4")
    p.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.step == "export":
        export(args.model, args.out, args.num_samples, args.seq_len)
    else:
        prune(args.dense, args.method, args.sparsity, args.pattern, args.out)


if __name__ == "__main__":
    main()
