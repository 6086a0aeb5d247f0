"""Tensor x pipeline parallel engines on local gloo processes give the one-process engine's greedy tokens and
logprobs (float32), and its embeddings, for a dense, an int4 and a 2:4 checkpoint of a tiny model whose 6 heads in
3 KV groups split unevenly over 2 ranks, and whose 3 layers split 2 + 1 over 2 stages."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from leanlm import LLM, PoolingParams, SamplingParams
from leanlm.engine.errors import EngineDeadError

PROMPTS = [[5, 17, 99, 3, 250, 7, 8], [400, 12], list(range(30, 70))]  # a decode, a short and a chunked prompt
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
SCORE = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
POOLINGS = [PoolingParams("last"), PoolingParams("mean", normalize=False)]
LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tensor_parallel_size, pipeline_parallel_size)


def _run(path: str, **options):
    with LLM(path, dtype="float32", progress=False, **options) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        scored = llm.generate(PROMPTS, SCORE, use_tqdm=False)
        # embeddings pool the final hidden rows, which a pipeline's last stage sends back beside the logits
        pooled = [o.embedding for p in POOLINGS for o in llm.embed(PROMPTS, p, use_tqdm=False)]
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    prompt = [[max(d.values()) for d in o.prompt_logprobs[1:]] for o in scored]
    return tokens, torch.tensor(sum(logprobs, [])), torch.tensor(sum(prompt, [])), torch.stack(pooled)


def _assert_same(got, want):
    assert got[0] == want[0]
    assert torch.allclose(got[1], want[1], atol=1e-4, rtol=0)
    assert torch.allclose(got[2], want[2], atol=1e-4, rtol=0)
    assert torch.allclose(got[3], want[3], atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_dense_parallel_layouts_equal_one_process(parallel_checkpoints, tp, pp):
    want = _run(parallel_checkpoints["dense"])
    _assert_same(_run(parallel_checkpoints["dense"], tensor_parallel_size=tp, pipeline_parallel_size=pp), want)


@pytest.mark.parametrize("fmt", ["int4", "2:4"])
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_quantized_and_sparse_checkpoints_shard_through_their_formats(parallel_checkpoints, fmt, tp, pp):
    want = _run(parallel_checkpoints[fmt])
    _assert_same(_run(parallel_checkpoints[fmt], tensor_parallel_size=tp, pipeline_parallel_size=pp), want)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_attention_sinks_and_a_window_reach_every_rank(parallel_checkpoints, tp, pp):
    window = dict(attention_window=6, attention_sinks=2, block_size=4)
    want = _run(parallel_checkpoints["dense"], **window)
    _assert_same(
        _run(parallel_checkpoints["dense"], tensor_parallel_size=tp, pipeline_parallel_size=pp, **window), want
    )


def test_more_micro_batches_than_stages_give_the_same_tokens(parallel_checkpoints):
    want = _run(parallel_checkpoints["dense"])
    _assert_same(_run(parallel_checkpoints["dense"], pipeline_parallel_size=2, pipeline_microbatches=3), want)


def test_a_dead_rank_fails_the_engine_fast_with_a_clear_error(parallel_checkpoints):
    llm = LLM(parallel_checkpoints["dense"], dtype="float32", progress=False, tensor_parallel_size=2)
    try:
        worker = llm.parallel.workers[0]
        worker.kill()
        worker.wait()
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1 .* exited"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 10
        assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_kv_blocks  # nothing leaked
    finally:
        llm.close()


def test_a_hung_rank_fails_the_engine_after_the_collective_timeout(parallel_checkpoints):
    options = dict(tensor_parallel_size=2, parallel_timeout_s=3)
    llm = LLM(parallel_checkpoints["dense"], dtype="float32", progress=False, **options)
    worker = llm.parallel.workers[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="parallel_timeout_s=3"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 30
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()
        llm.close()


# A worker that joins the store and announces it has started, then exits before the groups form: rank 0's
# init_process_group then fails inside torch (which advances torch's count of group names, see world.init_rank).
_DESERTER = """
import os, sys
from leanlm.parallel.driver import SPEC_ENV
from leanlm.parallel.rank import RankSpec
from leanlm.parallel.world import join_store, wait_for_ranks
spec = RankSpec.from_json(os.environ[SPEC_ENV])
store = join_store(spec.init_method, 2, 30)
wait_for_ranks(store, 1, 2, "joined", spec.secret)
sys.exit(0)
"""


def _spawn_instead(monkeypatch, code: str) -> None:
    """Rank 1 runs `code` (in a real child process, with the spec in its environment) instead of the worker."""
    import subprocess
    import sys

    from leanlm.parallel import driver

    def spawn(spec):
        env = dict(os.environ, **{driver.SPEC_ENV: spec.to_json(), driver.RANK_ENV: "1", "OMP_NUM_THREADS": "1"})
        return [subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL)]

    monkeypatch.setattr(driver, "spawn_workers", spawn)


def test_a_worker_that_dies_at_start_up_fails_the_engine_at_once_not_after_the_timeout(
    parallel_checkpoints, monkeypatch
):
    _spawn_instead(monkeypatch, "import sys; sys.exit(3)")
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 \(exit status 3\)"):
        LLM(parallel_checkpoints["dense"], dtype="float32", progress=False, tensor_parallel_size=2)
    assert time.monotonic() - started < 30  # the start-up wait is world.START_TIMEOUT_S (900 s)


def test_a_start_that_failed_inside_torch_leaves_the_process_able_to_start_another_engine(
    parallel_checkpoints, monkeypatch
):
    with monkeypatch.context() as patch:
        _spawn_instead(patch, _DESERTER)
        with pytest.raises(RuntimeError):  # DistStoreError: rank 1's gloo address never came
            LLM(parallel_checkpoints["dense"], dtype="float32", progress=False, tensor_parallel_size=2,
                parallel_timeout_s=2)  # fmt: skip
    want = _run(parallel_checkpoints["dense"])
    _assert_same(_run(parallel_checkpoints["dense"], tensor_parallel_size=2, parallel_timeout_s=20), want)


def test_a_collective_timeout_shorter_than_a_workers_start_up_still_starts(parallel_checkpoints, monkeypatch):
    """parallel_timeout_s bounds steps, not start-up: a worker slower to start than it (importing torch on a busy
    machine; a large checkpoint) must not fail the engine."""
    _spawn_instead(monkeypatch, "import time; time.sleep(2); from leanlm.parallel import worker; worker.main()")
    want = _run(parallel_checkpoints["dense"])
    _assert_same(_run(parallel_checkpoints["dense"], tensor_parallel_size=2, parallel_timeout_s=0.5), want)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_swap_preemption_moves_every_ranks_slice(parallel_checkpoints, tp, pp):
    """A KV pool too small for the batch: requests are swapped out and back on every rank, and the tokens are the
    one-process tokens without preemption."""
    tight = dict(num_kv_blocks=8, block_size=4, preemption_mode="swap", swap_space_bytes=16 << 20)
    want = _run(parallel_checkpoints["dense"])
    with LLM(parallel_checkpoints["dense"], dtype="float32", progress=False, tensor_parallel_size=tp,
             pipeline_parallel_size=pp, **tight) as llm:  # fmt: skip
        outs = llm.generate(PROMPTS[:2] * 2, GREEDY, use_tqdm=False)
        stats = llm.llm_engine.stats().scheduler
    assert stats.num_swaps_out > 0 and stats.num_swaps_in == stats.num_swaps_out
    assert [o.outputs[0].token_ids for o in outs] == want[0][:2] * 2


def test_under_torchrun_rank_0_drives_and_the_others_serve(parallel_checkpoints, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import sys\nfrom leanlm import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], dtype='float32', progress=False, tensor_parallel_size=2)\n"
        "out = llm.generate([[5, 17, 99]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))\n"
        "print('TOKENS', out[0].outputs[0].token_ids, flush=True)\nllm.close()\n"
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    done = subprocess.run([*torchrun, parallel_checkpoints["dense"]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with LLM(parallel_checkpoints["dense"], dtype="float32", progress=False) as llm:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        want = llm.generate([[5, 17, 99]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert done.stdout.count("TOKENS") == 1  # only rank 0 returns from LLM(...)
    assert f"TOKENS {want}" in done.stdout
