"""Cold start: from launching a server process on a GGUF file to its first generated token, `leanlm serve`
next to llama.cpp's `llama-server`, on the same file, in one run.

Each repetition starts a fresh process, waits until GET /health answers 200 (the model is loaded), then
times one /v1/completions request of one token. The file is read once before the first repetition, so every
repetition finds it in the page cache: this measures parsing and setting up, not the disk. Repetitions in
which other processes used more than --max-other-cpu of the CPUs are discarded.

    python benchmarks/cold_start.py --out docs/cold-start.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.peers import LlamaServer, LlamaServerConfig, PeerUnavailable, leanlm_server
from leanlm.loading.registry import DEFAULT_MODEL, resolve_model


def first_token_s(url: str, model: str) -> float:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
    return time.perf_counter() - t0


def one_start(make, model: str) -> tuple[float, float]:
    """(seconds from launch to healthy, seconds of the first one-token request)."""
    server = make()
    t0 = time.perf_counter()
    with server:
        ready = time.perf_counter() - t0
        return ready, first_token_s(server.url, model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-other-cpu", type=float, default=0.10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = resolve_model(args.model)
    path.read_bytes()  # into the page cache
    engines = {
        "leanlm serve": lambda: leanlm_server(args.model, port=8090),
        "llama-server": lambda: LlamaServer(LlamaServerConfig(path, parallel=1, ctx_per_slot=2048, port=8091)),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    discarded = dict.fromkeys(engines, 0)
    for _ in range(args.reps):
        for name, make in engines.items():
            try:
                with CpuMonitor() as mon:
                    sample = one_start(make, args.model)
            except PeerUnavailable as e:
                print(f"{name}: {e}")
                continue
            if mon.sample.is_contaminated(args.max_other_cpu):
                discarded[name] += 1
                continue
            results[name].append(sample)
            print(f"{name}: ready {sample[0]:.2f} s, first token {sample[1]:.3f} s", flush=True)
    lines = [
        f"Machine: {describe_machine()}. Model: {path.name}. Median of {args.reps} fresh starts per engine "
        "(file in the page cache).",
        "",
        "| engine | launch to healthy (s) | first 1-token request (s) | total (s) | discarded |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, samples in results.items():
        if not samples:
            lines.append(f"| {name} | - | - | - | {discarded[name]} |")
            continue
        ready = statistics.median(s[0] for s in samples)
        first = statistics.median(s[1] for s in samples)
        lines.append(f"| {name} | {ready:.2f} | {first:.3f} | {ready + first:.2f} | {discarded[name]} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(f"# Cold start (`python benchmarks/cold_start.py`)\n\n{text}")


if __name__ == "__main__":
    main()
