"""Benchmark peers in virtual environments of their own (OpenVINO GenAI, vLLM's CPU build) as runners of
`leanlm bench throughput`: each runs every batch size in one worker process (peer_process), and its CPU shares
come from the worker, which alone sees where a repetition starts and ends."""

from __future__ import annotations

import json
from pathlib import Path

from leanlm.analysis.bench import Repetitions
from leanlm.analysis.peer_models import ensure_dense_dir, ensure_openvino_ir
from leanlm.analysis.peer_process import OPENVINO, VLLM, PeerBatch, PeerRequest, PeerSpec, run_peer

# Peers in virtual environments of their own: --compare name -> (environment, OpenVINO weight format, or None for
# the dense bf16 HF directory). Throughput only.
PROCESS_PEERS = {
    "openvino": (OPENVINO, "fp16"),
    "openvino-int8": (OPENVINO, "int8"),
    "openvino-int4": (OPENVINO, "int4"),
    "vllm": (VLLM, None),
}


class PeerRunner:
    """A peer in a virtual environment of its own, through its worker process (peer_process): offline throughput
    only. One worker run covers every batch size (each with the peer's engine capped at that many running
    requests, and at most at `max_num_seqs`, our engine's cap); its CPU shares come from the worker."""

    def __init__(self, name: str, spec: PeerSpec, model_dir: Path, max_num_seqs: int, options: dict | None = None):
        self.name = name
        self.spec = spec
        self.model_dir = model_dir
        self.max_num_seqs = max_num_seqs
        self.options = options or {}
        self.info: dict | None = None  # what the worker reported about itself, after a sweep

    def throughput_sweep(
        self, prompts: list[list[int]], batch_sizes: list[int], output_len: int, reps: int, threshold: float
    ) -> dict[int, Repetitions]:
        batches = tuple(PeerBatch(min(b, self.max_num_seqs), b) for b in batch_sizes)
        request = PeerRequest(
            self.model_dir, tuple(map(tuple, prompts)), output_len, batches, reps, options=self.options
        )
        results = {b: Repetitions() for b in batch_sizes}
        run = run_peer(self.spec, request)
        self.info = run.info
        for rep in run.repetitions:
            results[rep.num_prompts].add(rep.output_tokens_per_s, rep.cpu, threshold)
        return results


def process_peer_runner(name: str, model: str, dtype: str, max_num_seqs: int) -> PeerRunner:
    """The PeerRunner of a --compare name, its model files written or exported on first use (peer_models)."""
    spec, weights = PROCESS_PEERS[name]
    if weights is not None:
        return PeerRunner(name, spec, ensure_openvino_ir(model, weights), max_num_seqs)
    options = {"engine_args": {"dtype": dtype}}  # vLLM computes in our dtype, on the dense bf16 weights
    return PeerRunner(name, spec, ensure_dense_dir(model), max_num_seqs, options)


def peer_notes(runners: list) -> list[str]:
    """What the process peers among `runners` reported about themselves (versions, settings), one line each."""
    notes = [
        f"{r.name}: {json.dumps(r.info, sort_keys=True)}"
        for r in runners
        if isinstance(r, PeerRunner) and r.info is not None
    ]
    if not notes:
        return []
    return [
        "",
        "OpenVINO and vLLM run in processes of their own (leanlm/analysis/peer_workers), their engine built for "
        "each batch size and capped at that many running requests; each worker measures its repetitions' CPU "
        "shares itself, its whole process tree counting as its own. They reported:",
        "",
        *(f"- {n}" for n in notes),
    ]
