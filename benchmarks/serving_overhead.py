"""Where a saturated `leanlm serve` spends its CPU: model forward, the engine's Python per step, detokenization,
the event loop's streaming path, the HTTP thread as a whole, and the load generator beside it.

The server runs as users run it, in its own process, but started through this script (`--as-server`), which
wraps the functions named in PHASES with counters of wall time and of the calling thread's CPU time before it
hands over to `leanlm serve`. CPU time is what the table reports: unlike wall time it does not grow when other
processes take the CPU, so the breakdown holds on a busy machine. The server's threads are read from
/proc/PID/task, the client's CPU from getrusage, other processes' share from /proc/stat (as benchmarks/serving.py).

    python benchmarks/serving_overhead.py --num-requests 64 --threads 1 --out docs/serving-overhead.md

`--threads 1` puts the whole forward on the engine thread, so "forward" is all of the model's CPU; with more
threads the OpenMP workers' share (and their spinning) shows as a thread of its own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

# (module, attribute path, label): each wrapped once; nested phases are reported inside their parent.
PHASES = (
    ("leanlm.engine.engine", "LLMEngine.step", "engine step"),
    ("leanlm.engine.scheduler", "Scheduler.schedule", "  schedule"),
    ("leanlm.engine.model_runner", "ModelRunner.forward", "  forward (layers + head, native)"),
    ("leanlm.engine.step_plan", "plan_step", "  step layout"),
    ("leanlm.engine.sampling_metadata", "SamplingMetadata.from_requests", "  sampling metadata"),
    ("leanlm.engine.sampler", "Sampler.sample", "  sampler"),
    ("leanlm.engine.scheduler", "Scheduler.update", "  update (stop checks, detokenizer)"),
    ("leanlm.loading.tokenizer", "IncrementalDetokenizer.step", "    detokenizer"),
    ("leanlm.engine.output_processor", "OutputProcessor.make_outputs", "  output processing"),
    ("leanlm.engine.async_engine", "AsyncLLMEngine._take_snapshot", "engine snapshot"),
    ("leanlm.engine.async_engine", "AsyncLLMEngine._deliver", "event loop: deliver outputs"),
    ("leanlm.server.streaming", "_delta_choices", "event loop: delta choices"),
    ("leanlm.server.streaming", "ChunkEncoder.__call__", "event loop: JSON + SSE encoding"),
)
TIMERS_ENV = "LEANLM_OVERHEAD_TIMERS"  # where the server writes its counters on SIGUSR1


# ------------------------------------------------------------------------------------ the server side


def install_timers(counters: dict[str, list[float]]) -> None:
    """Wrap each PHASES function; counters[label] = [calls, wall s, thread CPU s]."""
    for module_name, path, label in PHASES:
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        counters[label] = [0, 0.0, 0.0]
        setattr(owner, name, _timed(getattr(owner, name), counters[label]))
        if not parents:  # a module function: also where it was imported by name
            _rebind_imports(module_name, name, getattr(owner, name))


def _timed(fn, counter: list[float]):
    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            counter[0] += 1
            counter[1] += time.perf_counter() - wall
            counter[2] += time.thread_time() - cpu

    return timed


def _rebind_imports(module_name: str, name: str, wrapped) -> None:
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("leanlm.") and module.__name__ != module_name:
            if callable(getattr(module, name, None)) and getattr(module, name).__module__ == module_name:
                setattr(module, name, wrapped)


def run_server(argv: list[str]) -> int:
    """`leanlm serve ARGV` with the timers; SIGUSR1 writes them (and the thread names) to $TIMERS_ENV, then zeroes."""
    import threading

    from leanlm.cli.main import main

    counters: dict[str, list[float]] = {}
    install_timers(counters)
    out = Path(os.environ[TIMERS_ENV])

    def dump(signum, frame) -> None:
        threads = {str(t.native_id): t.name for t in threading.enumerate()}
        out.write_text(json.dumps({"counters": counters, "threads": threads}))
        for counter in counters.values():
            counter[:] = [0, 0.0, 0.0]

    signal.signal(signal.SIGUSR1, dump)
    return main(argv)


# ------------------------------------------------------------------------------------ the client side


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, by thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        cpu[tid] = (int(fields[11]) + int(fields[12])) / ticks
    return cpu


def measure(args) -> dict:
    """One saturated load after a warm-up, against the timed server; everything the report needs."""
    from leanlm.analysis.host import CpuMonitor
    from leanlm.analysis.load_generator import LoadConfig, prompts_from_file, run_load_sync
    from leanlm.analysis.peers import ServerProcess
    from leanlm.data import wikitext2_test_path
    from leanlm.formats.stored import load_tokenizer
    from leanlm.loading.registry import resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    prompts = prompts_from_file(wikitext2_test_path(), tokenizer, args.warmup + args.num_requests, args.input_len)
    timers = Path(f"/tmp/leanlm-overhead-{os.getpid()}.json")
    os.environ[TIMERS_ENV] = str(timers)
    serve = ["serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(args.port), "--log-level", "warning"]
    serve += ["--threads", str(args.threads)] if args.threads else []
    command = [sys.executable, __file__, "--as-server", *serve]
    server = ServerProcess("leanlm-serve", command, f"http://127.0.0.1:{args.port}").start()
    try:
        common = dict(url=server.url, output_len=args.output_len, eos_token_ids=tokenizer.eos_token_ids, seed=0)
        run_load_sync(LoadConfig(**common, num_requests=args.warmup), prompts[: args.warmup], progress=False)
        os.kill(server.pid, signal.SIGUSR1)  # zero the counters
        time.sleep(0.5)
        before, usage = thread_cpu(server.pid), resource.getrusage(resource.RUSAGE_SELF)
        config = LoadConfig(**common, num_requests=args.num_requests)  # all at once: saturation
        with CpuMonitor(pids=(server.pid,)) as monitor:
            result = run_load_sync(config, prompts[args.warmup :], progress=False)
        after, usage_after = thread_cpu(server.pid), resource.getrusage(resource.RUSAGE_SELF)
        os.kill(server.pid, signal.SIGUSR1)
        time.sleep(0.5)
        dumped = json.loads(timers.read_text())
    finally:
        server.stop()
        timers.unlink(missing_ok=True)
    names = dumped["threads"]
    threads = {names.get(t, "OpenMP worker"): after[t] - before.get(t, 0.0) for t in after}
    client = usage_after.ru_utime + usage_after.ru_stime - usage.ru_utime - usage.ru_stime
    return dict(result=result, cpu=monitor.sample, counters=dumped["counters"], threads=threads, client=client)


def render(args, m: dict) -> str:
    from leanlm.analysis.host import describe_machine

    r, counters = m["result"], m["counters"]
    steps = max(1, counters["engine step"][0])
    lines = [
        "## A saturated `leanlm serve`: CPU per engine step",
        "",
        f"Machine: {describe_machine()}. `leanlm serve --threads {args.threads or 'default'}` on the bundled "
        f"SmolLM2-135M GGUF; {args.num_requests} streamed requests sent at once (prompts of about {args.input_len} "
        f"tokens, {args.output_len} greedy tokens each, EOS suppressed by logit_bias), after {args.warmup} warm-up "
        f"requests. {r.output_throughput:.1f} output tok/s, TTFT p50 {r.ttft.p50:,.0f} ms, {steps} engine steps, "
        f"{r.num_failed} failed. Other processes used {m['cpu'].other_share:.1%} of the CPUs meanwhile.",
        "",
        f"Command: `python benchmarks/serving_overhead.py {' '.join(sys.argv[1:])}`",
        "",
        "| where | calls | CPU ms per step | wall ms per step |",
        "|---|---:|---:|---:|",
    ]
    for label, (calls, wall, cpu) in counters.items():
        lines.append(f"| {label.strip()} | {calls} | {1e3 * cpu / steps:.2f} | {1e3 * wall / steps:.2f} |")
    lines += ["", "| thread or process | CPU s in the run | CPU ms per step |", "|---|---:|---:|"]
    for name, seconds in sorted(m["threads"].items(), key=lambda kv: -kv[1]):
        if seconds > 0.005:
            lines.append(f"| server: {name} | {seconds:.2f} | {1e3 * seconds / steps:.2f} |")
    lines.append(f"| load generator (client) | {m['client']:.2f} | {1e3 * m['client'] / steps:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if sys.argv[1:2] == ["--as-server"]:
        return run_server(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="bundled name or GGUF path")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="`leanlm serve --threads` (default: torch's)")
    parser.add_argument("--port", type=int, default=8095)
    parser.add_argument("--out", default=None, help="markdown file whose 'serving-overhead' section gets the report")
    args = parser.parse_args()
    report = render(args, measure(args))
    print(report)
    if args.out:
        from leanlm.analysis.markdown import replace_section

        replace_section(Path(args.out), "serving-overhead", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
