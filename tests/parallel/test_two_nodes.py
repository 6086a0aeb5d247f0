"""A 2-node-shaped world on loopback: two torchrun invocations (--nnodes 2, one process each, node ranks 0 and 1)
running `leanlm generate --tensor-parallel-size 2` join through torchrun's env:// rendezvous; rank 0 prints the
one-process greedy tokens, rank 1 serves its steps and exits 0 (docs/parallelism.md gives the commands)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from leanlm import LLM, SamplingParams

pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_node_commands(model: str, port: int, *generate_args: str) -> list[list[str]]:
    """The two torchrun command lines, node 0 then node 1 (as an operator types them on two hosts)."""
    return [
        [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "leanlm", "generate", "--model", model, *generate_args, PROMPT,
        ]
        for node in (0, 1)
    ]  # fmt: skip


@pytest.mark.parametrize("layout", [["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"]])
def test_two_torchrun_nodes_give_one_process_greedy_tokens(layout):
    from tests.server.conftest import MODEL

    args = [*layout, "--dtype", "float32", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    nodes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for c in two_node_commands(MODEL, _free_port(), *args)]  # fmt: skip
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    printed = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
    assert outputs[1][0].strip() == ""  # node 1's rank never returns from LLM(...): it served, then exited
    with LLM(MODEL, dtype="float32", progress=False) as llm:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        want = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    assert len(printed) == 1 and printed[0]["text"] == want
