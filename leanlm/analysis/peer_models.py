"""The model files the peers load, cached under PEERS_DIR (beside the checkout): a dense bf16 HF directory written
from LeanLM's own load of the model (what HF transformers, vLLM and optimum-intel read), and OpenVINO IR exports of
it at fp16, int8 and int4 weights. Each is written once, into a temporary directory renamed into place, and reused.

    python -m leanlm.analysis.peer_models [--model NAME] [--openvino fp16,int8,int4]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from leanlm.analysis.peer_process import OPENVINO
from leanlm.analysis.peers import PEERS_DIR, PeerUnavailable

# optimum-cli's weight arguments, as close to LeanLM's schemes as NNCF gets: int8 weight-only is symmetric per
# output channel (as ours); int4 is asymmetric (with zero points) in groups of 64 on every linear layer (ratio 1.0),
# and NNCF keeps the embedding, which the head is tied to, at int8 per channel, as our int4 checkpoints keep the head.
OPENVINO_WEIGHTS = {
    "fp16": ("--weight-format", "fp16"),
    "int8": ("--weight-format", "int8", "--sym"),
    "int4": ("--weight-format", "int4", "--group-size", "64", "--ratio", "1.0"),
}


def model_slug(model: str) -> str:
    """The cache name of a model: a bundled model's name, else its file or directory name without suffix."""
    path = Path(model)
    return (path.stem if path.suffix == ".gguf" else path.name).lower()


def dense_dir(model: str) -> Path:
    return PEERS_DIR / f"{model_slug(model)}-dense"


def openvino_dir(model: str, weights: str) -> Path:
    if weights not in OPENVINO_WEIGHTS:
        raise ValueError(f"unknown OpenVINO weight format {weights!r}; use one of {sorted(OPENVINO_WEIGHTS)}")
    return PEERS_DIR / f"{model_slug(model)}-ov-{weights}"


def write_dense_dir(model: str, out: Path) -> None:
    """The model as LeanLM loads it, dequantized, saved as bf16 safetensors plus config and tokenizer."""
    from leanlm.formats import load_checkpoint, save_checkpoint

    save_checkpoint(load_checkpoint(model, "bfloat16", progress=False), out)


def _build_once(target: Path, marker: str, build) -> Path:
    """`build(tmp)` into a temporary directory beside `target`, renamed into place; skipped when target/marker
    exists (a build that died leaves only its temporary directory, never a half-written target)."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_dense_dir(model: str) -> Path:
    return _build_once(dense_dir(model), "config.json", lambda tmp: write_dense_dir(model, tmp))


def ensure_openvino_ir(model: str, weights: str) -> Path:
    """The OpenVINO IR of the model at `weights`, exported with optimum-cli from the OpenVINO environment (with its
    tokenizer, converted by openvino-tokenizers) on first use."""
    if not OPENVINO.is_installed():
        raise PeerUnavailable(OPENVINO.missing_message())
    source = ensure_dense_dir(model)
    cli = OPENVINO.venv / "bin" / "optimum-cli"

    def export(tmp: Path) -> None:
        command = [str(cli), "export", "openvino", "--model", str(source), "--task", "text-generation-with-past"]
        done = subprocess.run([*command, *OPENVINO_WEIGHTS[weights], str(tmp)], capture_output=True, text=True)
        if done.returncode != 0:
            raise PeerUnavailable(f"optimum-cli export ({weights}) failed:\n{done.stderr[-3000:]}")

    return _build_once(openvino_dir(model, weights), "openvino_model.xml", export)


def main() -> None:
    from leanlm.loading.registry import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description="Write the peers' model files (a cache under PEERS_DIR).")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--openvino", default="", help="OpenVINO weight formats to export: fp16,int8,int4")
    args = ap.parse_args()
    print(ensure_dense_dir(args.model))
    for weights in filter(None, args.openvino.split(",")):
        print(ensure_openvino_ir(args.model, weights))


if __name__ == "__main__":
    main()
