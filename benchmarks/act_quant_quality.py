"""What dynamic int8 activations cost in quality (`--act-quant int8`: W4A8 / W8A8-dynamic, groups of 32), beside
what OpenVINO's CPU plugin costs with its default dynamic quantization (DYNAMIC_QUANTIZATION_GROUP_SIZE 32) on its
own int8 and int4 IRs of the same model: KL(bf16 activations || int8 activations) per token, top-1 agreement, and
WikiText-2 perplexity with each.

    python benchmarks/act_quant_quality.py --windows 16 --out docs/act-quant.md

LeanLM's rows: the bundled Q4_1 GGUF on its codes, and the RTN int8 (per channel, head int8) and int4 g64 (head
int8) checkpoints of benchmarks/batched_decode.py. OpenVINO's rows: its fp16 / int8 / int4 g64 IRs from
`make peers-openvino`, scored by benchmarks/ov_logits_worker.py in that environment. The same token windows for all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from quantized_decode import quantized_dir

from leanlm.analysis.eval import kl_divergence, make_windows, read_text
from leanlm.analysis.host import describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.analysis.peers import PEERS_DIR
from leanlm.data import wikitext2_test_path
from leanlm.llm import LLM
from leanlm.loading.registry import DEFAULT_MODEL, resolve_model

OV_PYTHON = PEERS_DIR / "openvino-venv" / "bin" / "python"
WORKER = Path(__file__).resolve().with_name("ov_logits_worker.py")


def leanlm_rows(windows) -> list[list[str]]:
    gguf = str(resolve_model(DEFAULT_MODEL))
    models = {"Q4_1 GGUF codes": gguf}
    for kind, label in (("int8", "int8 RTN per channel"), ("int4", "int4 g64 RTN")):
        models[label] = str(quantized_dir(gguf, kind, PEERS_DIR / "leanlm-checkpoints"))
    rows = []
    for label, model in models.items():
        base = LLM(model, enable_prefix_caching=False, act_quant="none")
        quant = LLM(model, enable_prefix_caching=False, act_quant="int8")
        r = kl_divergence(base, quant, windows, use_tqdm=False)
        rows.append(["LeanLM", label, "int8, groups of 32", f"{r.mean_kl:.4f}", f"{r.kl_quantile(0.99):.3f}",
                     f"{100 * r.top1_agreement:.1f}%", f"{r.base.perplexity:.3f}", f"{r.model.perplexity:.3f}",
                     f"{100 * (r.model.perplexity / r.base.perplexity - 1):+.2f}%"])  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def openvino_rows(windows, groups: list[int]) -> list[list[str]]:
    rows = []
    for weights in ("fp16", "int8", "int4"):
        ir = PEERS_DIR / f"{DEFAULT_MODEL}-ov-{weights}"
        if not (OV_PYTHON.is_file() and ir.is_dir()):
            print(f"skipping OpenVINO {weights}: {ir} or {OV_PYTHON} is missing (make peers-openvino)")
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump({"ir": str(ir), "windows": [list(w.token_ids) for w in windows], "group_sizes": groups}, f)
            f.flush()
            out = subprocess.run([str(OV_PYTHON), str(WORKER), f.name], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{WORKER.name} failed on {ir}:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        for group, s in result["settings"].items():
            rows.append(["OpenVINO", f"{weights} IR", f"int8, groups of {group}", f"{s['kl']:.4f}", "-",
                         f"{100 * s['top1']:.1f}%", f"{result['ppl_off']:.3f}", f"{s['ppl']:.3f}",
                         f"{100 * (s['ppl'] / result['ppl_off'] - 1):+.2f}%"])  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=16, help="WikiText-2 windows scored")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--ov-groups", default="32", help="OpenVINO dynamic quantization group sizes to compare")
    ap.add_argument("--out", default=None, help="markdown file whose act-quant-quality section is rewritten")
    args = ap.parse_args()
    tokenizer = LLM(DEFAULT_MODEL).get_tokenizer()
    ids = tokenizer.encode(read_text(wikitext2_test_path()))
    windows = make_windows(ids, args.seq_len, max_windows=args.windows)
    rows = leanlm_rows(windows) + openvino_rows(windows, [int(g) for g in args.ov_groups.split(",")])
    header = ["engine", "weights", "activations", "mean KL (nats)", "KL p99", "top-1 agreement", "ppl, 16-bit act",
              "ppl, int8 act", "ppl change"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    body = (
        f"Machine: {describe_machine()}.\n\nCommand: `python benchmarks/act_quant_quality.py --windows {args.windows} "
        f"--seq-len {args.seq_len}`. WikiText-2 raw test, {len(windows)} windows of {args.seq_len} tokens; KL is "
        "KL(16-bit activations || int8 activations) per scored token, on the same weights.\n\n" + "\n".join(lines)
    )
    print(body)
    if args.out:
        replace_section(Path(args.out), "act-quant-quality", body)


if __name__ == "__main__":
    main()
