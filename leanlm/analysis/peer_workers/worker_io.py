"""The peer-worker protocol, worker side (standard library only; see __init__): one JSON request on stdin, one JSON
line per event on stdout, a traceback on stderr and exit status 1 on failure.

Request: {"model_dir", "prompts": [[token ids]], "output_len", "batches": [{"max_num_seqs", "num_prompts"}],
"reps", "warmup", "kv_cache_gib", "max_num_batched_tokens", "options": {peer-specific}}, and optionally
"distinct_reps": true (each repetition runs prompts of its own, see prompt_sets).
Events, in order: "info" (versions and settings), then per batch "loaded" (load_s) and one "repetition" per
rep (output_token_ids, wall_s, first_token_s or null, cpu), and "done" last.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proc_cpu import cpu_shares, process_tree, take_snapshot

REQUEST_FIELDS = {
    "model_dir": str,
    "prompts": list,
    "output_len": int,
    "batches": list,
    "reps": int,
    "warmup": bool,
    "kv_cache_gib": int,
    "max_num_batched_tokens": int,
    "options": dict,
}
WARMUP_TOKENS = 4  # the warm-up generation: enough to run prefill and decode steps once


def parse_request(text: str) -> dict:
    """The request as a dict, checked field by field (the message names the field that is wrong)."""
    request = json.loads(text)
    for name, kind in REQUEST_FIELDS.items():
        if not isinstance(request.get(name), kind):
            raise ValueError(f"request field {name!r} must be a {kind.__name__}, got {request.get(name)!r}")
    if not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in request["prompts"]):
        raise ValueError("request field 'prompts' must be non-empty lists of token ids")
    sets = request["reps"] + 1 if request.setdefault("distinct_reps", False) else 1
    for batch in request["batches"]:
        cap, count = batch.get("max_num_seqs"), batch.get("num_prompts")
        if not (isinstance(cap, int) and isinstance(count, int) and cap >= 1 and count >= 1):
            raise ValueError(f"batch {batch} needs max_num_seqs >= 1 and num_prompts >= 1")
        if count * sets > len(request["prompts"]):
            raise ValueError(f"batch {batch} needs {count * sets} prompts ({sets} set(s) of num_prompts)")
    return request


def prompt_sets(request: dict, batch: dict) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(the warm-up's prompts, each repetition's prompts). Plain: the first num_prompts prompts for every
    repetition, the warm-up on the first max_num_seqs of them. distinct_reps: consecutive sets of num_prompts,
    the first for the warm-up and one per repetition, so that with a prefix cache on (a shared system prompt),
    no repetition finds its own prompts cached, only what they share."""
    n = batch["num_prompts"]
    if request["distinct_reps"]:
        sets = [request["prompts"][i * n : (i + 1) * n] for i in range(request["reps"] + 1)]
        return sets[0], sets[1:]
    prompts = request["prompts"][:n]
    return prompts[: batch["max_num_seqs"]], [prompts] * request["reps"]


def open_event_stream():
    """The real stdout, kept for events; fd 1 then points at stderr. The peer stacks print to stdout (vLLM's logger,
    C++ code, the processes they spawn, which inherit fd 1), and a stray line must never be read as an event."""
    events = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return events


@dataclass
class Engine:
    """What a worker module supplies for one batch cap: generate(prompts, output_len) -> (token ids per prompt,
    seconds to the first token or None where the peer does not report it) and close()."""

    generate: Callable[[list[list[int]], int], tuple[list[list[int]], float | None]]
    close: Callable[[], None]


def timed(generate: Callable[[], Any]):
    """(result, wall seconds of the call alone, cpu): cpu holds the CPU shares of this worker's whole process tree
    (the peer's engine processes, such as vLLM's engine core and its model worker, count as own) and of
    everything else. The tree is listed again at the end, so processes started meanwhile count as own."""
    start = take_snapshot(process_tree(os.getpid()))
    t0 = time.perf_counter()
    result = generate()
    wall_s = time.perf_counter() - t0
    end = take_snapshot(process_tree(os.getpid()))
    seconds, own, other = cpu_shares(start, end)
    return result, wall_s, {"seconds": seconds, "own_share": own, "other_share": other}


def run_batches(request: dict, load: Callable[[dict, int], Engine], emit: Callable[..., None]) -> None:
    """Every batch of the request: load the peer capped at max_num_seqs, warm it up, time each repetition."""
    for batch in request["batches"]:
        cap = batch["max_num_seqs"]
        warmup_prompts, rep_prompts = prompt_sets(request, batch)
        t0 = time.perf_counter()
        engine = load(request, cap)
        emit("loaded", max_num_seqs=cap, load_s=time.perf_counter() - t0)
        try:
            if request["warmup"]:
                engine.generate(warmup_prompts, WARMUP_TOKENS)
            for rep, prompts in enumerate(rep_prompts):
                (tokens, first_token_s), wall_s, cpu = timed(lambda: engine.generate(prompts, request["output_len"]))
                emit(
                    "repetition",
                    max_num_seqs=cap,
                    num_prompts=len(prompts),
                    rep=rep,
                    output_token_ids=tokens,
                    wall_s=wall_s,
                    first_token_s=first_token_s,
                    cpu=cpu,
                )
        finally:
            engine.close()


def serve(
    describe: Callable[[dict], dict],
    load: Callable[[dict, int], Engine],
    prepare: Callable[[dict], None] = lambda request: None,
) -> int:
    """A worker's main(): read the request, `prepare(request)` (before the peer's stack is imported, e.g. its
    environment variables), report `describe(request)` as the info event, run every batch."""
    events = open_event_stream()

    def emit(event: str, **fields) -> None:
        events.write(json.dumps({"event": event, **fields}) + "\n")

    try:
        request = parse_request(sys.stdin.read())
        prepare(request)
        emit("info", **describe(request))
        run_batches(request, load, emit)
        emit("done")
        return 0
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        return 1
