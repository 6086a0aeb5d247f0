"""Does a GPTQ checkpoint we export load and run in Hugging Face transformers? One run: quantize with GPTQ
(4 bits, group 64, symmetric, act-order), write the AutoGPTQ/GPTQModel layout (`--format gptq`), load the
directory with transformers' own GPTQ integration (which needs the `gptqmodel` package) and with leanlm, and
compare the two on WikiText-2 text: per-token KL divergence and top-1 agreement of their next-token
distributions, and greedy continuations.

    PYTHONPATH=<dir holding gptqmodel and its deps> python benchmarks/gptq_interop.py --doc docs/quantization.md

gptqmodel is not a leanlm dependency: its releases pin a newer torch than ours. Install it (and the
dependencies it imports) into a separate directory with `pip install --target DIR --no-deps` and put that
directory on PYTHONPATH for this script only.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from leanlm.analysis.eval import read_text
from leanlm.analysis.host import describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.compress import calibration_samples, compress, read_calibration_text
from leanlm.compress.named_recipes import build_recipe
from leanlm.data import wikitext2_test_path
from leanlm.formats import load_checkpoint, save_gptq_checkpoint
from leanlm.llm import LLM
from leanlm.sampling_params import SamplingParams

WIKITEXT = wikitext2_test_path()  # packaged with leanlm (leanlm/data)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process by which"]


def hf_log_probs(model, ids: list[int]) -> torch.Tensor:
    """[T-1, V] float32 log-softmax of transformers' logits at positions 0..T-2."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="bench-results/gptq-interop/smollm2-gptq-w4g64")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=512, help="tokens of WikiText-2 scored by both")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--doc", default=None)
    args = ap.parse_args()
    import transformers  # noqa: F401  (fail early: the point of the run)
    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    ckpt = load_checkpoint(args.model, progress=False)
    model, tok = ckpt.model, ckpt.tokenizer
    samples = calibration_samples(
        tok.encode(read_calibration_text(), add_special_tokens=False), args.num_samples, args.calib_seq_len
    )
    recipe = build_recipe("gptq", bits=4, group_size=64, symmetric=True, act_order=True)
    compress(model, recipe, samples, progress=False)
    save_gptq_checkpoint(ckpt, out)
    del model, ckpt

    ours = LLM(str(out), dtype="bfloat16", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(out), device_map="cpu", dtype=torch.bfloat16).eval()
    hf_layer = type(hf.model.layers[0].self_attn.q_proj).__name__

    ids = tok.encode(read_text(str(WIKITEXT)), add_special_tokens=False)[: args.seq_len]
    theirs_lp = hf_log_probs(hf, ids)
    ours_lp = ours.score([ids], use_tqdm=False)[0]
    kl = (theirs_lp.exp() * (theirs_lp - ours_lp)).sum(-1)  # KL(transformers || leanlm) per position
    agree = (theirs_lp.argmax(-1) == ours_lp.argmax(-1)).float().mean().item()
    nll = lambda lp: -lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item()  # noqa: E731

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    lines = []
    for prompt in PROMPTS:
        p_ids = tok.encode(prompt, add_special_tokens=False)
        hf_new = hf.generate(
            torch.tensor([p_ids]), max_new_tokens=args.new_tokens, do_sample=False, min_new_tokens=args.new_tokens
        )[0, len(p_ids) :].tolist()
        our_new = ours.generate([p_ids], params, use_tqdm=False)[0].outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(hf_new, our_new)) if a != b), None)
        same = "all" if first is None else f"first {first}"
        lines.append(
            f"| `{prompt}` | {same} of {args.new_tokens} | {tok.decode(hf_new[:12])!r} | {tok.decode(our_new[:12])!r} |"
        )

    report = "\n".join(
        [
            f"GPTQ W4 g64 symmetric act-order export of {args.model} (`--format gptq`, {args.num_samples} x "
            f"{args.calib_seq_len} calibration tokens), loaded by transformers {transformers.__version__} "
            f"(its GPTQ integration through gptqmodel, layer `{hf_layer}`) and by leanlm, both in bfloat16. "
            f"Machine: {describe_machine()}. Command: `python benchmarks/gptq_interop.py`.",
            "",
            f"- First {len(ids)} WikiText-2 test tokens: mean KL(transformers || leanlm) {kl.mean().item():.5f} nats, "
            f"max {kl.max().item():.4f}; top-1 agreement {agree:.3f}; perplexity transformers "
            f"{math.exp(nll(theirs_lp)):.3f}, leanlm {math.exp(nll(ours_lp)):.3f}.",
            "",
            "| prompt | greedy tokens equal | transformers | leanlm |",
            "|---|---|---|---|",
            *lines,
        ]
    )
    print(report)
    if args.doc:
        replace_section(Path(args.doc), "gptq-interop", report)


if __name__ == "__main__":
    main()
