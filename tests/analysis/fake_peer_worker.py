"""A stand-in peer worker for the runner's tests: the real protocol (worker_io) around a fake engine, plain Python
with no peer stack. request["options"]["fake"] picks how it behaves:
  ok     token t of prompt p is (sum(p) + t) % 997
  crash  loading fails with a RuntimeError (traceback on stderr, exit status 1)
  short  one token fewer than asked
  noise  prints to stdout from Python, from C (a child process) and from a grandchild: none may reach the events
  burn   each generation starts a child whose child uses 0.3 s of CPU and stays alive (as vLLM's engine
         processes do): the grandchild's time must count as the worker's own
  hang   each generation sleeps for a minute beside a child that sleeps too (the timeout must kill both)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "leanlm" / "analysis" / "peer_workers"))

from worker_io import Engine, serve  # noqa: E402

# A process that uses 0.3 s of CPU time (however long that takes on a busy machine), says so, and sleeps.
BURN = "import time\nwhile time.process_time() < 0.3:\n    pass\nprint('burned', flush=True)\ntime.sleep(60)\n"


def describe(request: dict) -> dict:
    return {"peer": "fake", "mode": request["options"]["fake"], "versions": {"fake": "1.0"}}


def fake_tokens(prompts: list[list[int]], output_len: int) -> list[list[int]]:
    return [[(sum(p) + t) % 997 for t in range(output_len)] for p in prompts]


def load(request: dict, max_num_seqs: int) -> Engine:
    mode = request["options"]["fake"]
    spawned: list[subprocess.Popen] = []  # left running until close(), the end of the batch
    if mode == "crash":
        raise RuntimeError("fake model failed to load: out of cheese")

    def generate(prompts: list[list[int]], output_len: int):
        if mode == "noise":
            print("a peer's log line on stdout")
            os.system("echo a child process writing to stdout")
            subprocess.run([sys.executable, "-c", "import os; os.system('echo a grandchild on stdout')"], check=True)
        if mode == "burn":  # child -> grandchild (inheriting the pipe): the tree, not only children, is own
            grandchild = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN!r}])"
            child = subprocess.Popen([sys.executable, "-c", grandchild], stdout=subprocess.PIPE, text=True)
            assert child.stdout.readline() == "burned\n"
            spawned.append(child)
        if mode == "hang":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            print(f"child pid {child.pid}", file=sys.stderr, flush=True)
            time.sleep(60)
        tokens = fake_tokens(prompts, output_len - (mode == "short"))
        return tokens, 0.001 if mode == "ok" else None

    def close() -> None:
        for child in spawned:
            child.kill()  # its child, orphaned, goes with the session when the runner ends it
            child.wait()

    return Engine(generate=generate, close=close)


if __name__ == "__main__":
    sys.exit(serve(describe, load))
