"""The peer runner's side of the worker protocol, against a fake worker (tests/analysis/fake_peer_worker.py: the real
worker_io around a fake engine, no peer stack): requests in, events parsed, failures reported with the worker's
stderr, timeouts ending the whole process tree, and CPU accounting that counts the worker's descendants as own."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from leanlm.analysis.peer_process import (
    PeerBatch,
    PeerRequest,
    PeerSpec,
    PeerWorkerError,
    parse_events,
    run_peer,
)

FAKE_WORKER = Path(__file__).with_name("fake_peer_worker.py")
PROMPTS = ((1, 2, 3), (10, 20), (7,))


def request(mode: str, **changes) -> PeerRequest:
    fields = dict(
        model_dir=Path("/nowhere"),
        prompts=PROMPTS,
        output_len=5,
        batches=(PeerBatch(2, 3), PeerBatch(1, 1)),
        reps=2,
        options={"fake": mode},
    )
    return PeerRequest(**(fields | changes))


def expected_tokens(prompts, output_len: int):
    return tuple(tuple((sum(p) + t) % 997 for t in range(output_len)) for p in prompts)


def test_a_request_runs_every_batch_and_repetition_in_order(fake_peer_spec):
    lines = []
    run = run_peer(fake_peer_spec, request("ok"), timeout_s=60, on_line=lines.append)
    assert run.info == {"peer": "fake", "mode": "ok", "versions": {"fake": "1.0"}}
    assert sorted(run.load_s) == [1, 2] and all(s >= 0 for s in run.load_s.values())
    assert [(r.max_num_seqs, r.num_prompts, r.rep) for r in run.repetitions] == [
        (2, 3, 0),
        (2, 3, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    first = run.repetitions[0]
    assert first.output_token_ids == expected_tokens(PROMPTS, 5)
    assert run.repetitions[2].output_token_ids == expected_tokens(PROMPTS[:1], 5)
    assert first.num_output_tokens == 15 and first.wall_s > 0 and first.first_token_s == 0.001
    assert first.output_tokens_per_s == pytest.approx(15 / first.wall_s)
    assert 0 <= first.cpu.own_share <= 1 and 0 <= first.cpu.other_share <= 1 and first.cpu.seconds > 0
    assert json.loads(lines[0])["event"] == "info" and json.loads(lines[-1]) == {"event": "done"}


def test_the_worker_reads_exactly_what_the_runner_sends(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE_WORKER.parents[2] / "leanlm" / "analysis" / "peer_workers"))
    from worker_io import parse_request

    sent = request("ok", kv_cache_gib=3, max_num_batched_tokens=512)
    got = parse_request(sent.to_json())
    assert got["prompts"] == [list(p) for p in PROMPTS] and got["model_dir"] == "/nowhere"
    assert got["batches"] == [{"max_num_seqs": 2, "num_prompts": 3}, {"max_num_seqs": 1, "num_prompts": 1}]
    assert (got["kv_cache_gib"], got["max_num_batched_tokens"], got["warmup"]) == (3, 512, True)
    with pytest.raises(ValueError, match="'output_len' must be a int"):
        parse_request(json.dumps(json.loads(sent.to_json()) | {"output_len": "5"}))
    with pytest.raises(ValueError, match=r"needs 4 prompts \(1 set"):
        parse_request(json.dumps(json.loads(sent.to_json()) | {"batches": [{"max_num_seqs": 1, "num_prompts": 4}]}))
    assert got["distinct_reps"] is False
    with pytest.raises(ValueError, match=r"needs 9 prompts \(3 set"):  # 2 repetitions + the warm-up, of 3 each
        parse_request(json.dumps(json.loads(sent.to_json()) | {"distinct_reps": True}))


def test_distinct_repetitions_run_prompt_sets_of_their_own(fake_peer_spec):
    """distinct_reps: the warm-up runs the first set of num_prompts, repetition r the set after it (a prefix cache
    then holds what the sets share and never a repetition's own prompts)."""
    prompts = tuple((i, i + 1) for i in range(7))
    sent = request("ok", prompts=prompts, batches=(PeerBatch(2, 2),), distinct_reps=True)
    run = run_peer(fake_peer_spec, sent, timeout_s=60)
    assert [r.output_token_ids for r in run.repetitions] == [
        expected_tokens(prompts[2:4], 5),
        expected_tokens(prompts[4:6], 5),
    ]


def test_a_worker_that_crashes_is_reported_with_its_stderr(fake_peer_spec):
    with pytest.raises(PeerWorkerError, match=r"(?s)fake worker exited with status 1.*out of cheese"):
        run_peer(fake_peer_spec, request("crash"), timeout_s=60)


def test_a_repetition_short_of_tokens_is_an_error(fake_peer_spec):
    with pytest.raises(PeerWorkerError, match=r"asked for 5 tokens for each of 3 prompts, got \[4, 4, 4\]"):
        run_peer(fake_peer_spec, request("short"), timeout_s=60)


def test_what_peers_print_to_stdout_never_reaches_the_events(fake_peer_spec):
    run = run_peer(fake_peer_spec, request("noise", batches=(PeerBatch(1, 1),), reps=1), timeout_s=60)
    assert len(run.repetitions) == 1


def test_stray_lines_and_a_missing_done_are_protocol_errors():
    with pytest.raises(ValueError, match="not a worker event: 'hello'"):
        parse_events(["hello"], request("ok"))
    with pytest.raises(ValueError, match="without its 'done' event"):
        parse_events(['{"event": "info"}'], request("ok"))


def test_a_hung_worker_is_killed_with_its_children_at_the_timeout(fake_peer_spec):
    t0 = time.monotonic()
    with pytest.raises(PeerWorkerError, match=r"(?s)was killed after 3 s.*child pid (\d+)") as error:
        run_peer(fake_peer_spec, request("hang"), timeout_s=3)
    assert time.monotonic() - t0 < 30
    child = int(re.search(r"child pid (\d+)", str(error.value)).group(1))
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split(")")[1][:3]


def test_a_missing_environment_says_how_to_set_it_up(tmp_path):
    spec = PeerSpec("fake", tmp_path / "no-venv", FAKE_WORKER, "make peers-fake")
    assert not spec.is_installed()
    with pytest.raises(PeerWorkerError, match=r"fake is not set up .*no-venv/bin/python is missing.*make peers-fake"):
        run_peer(spec, request("ok"))


def test_request_validation():
    with pytest.raises(ValueError, match="no empty prompt"):
        request("ok", prompts=((1,), ()))
    with pytest.raises(ValueError, match="1 set.* within the 3 prompts"):
        request("ok", batches=(PeerBatch(1, 4),))
    with pytest.raises(ValueError, match="3 set.* within the 3 prompts"):
        request("ok", batches=(PeerBatch(1, 2),), distinct_reps=True)
    with pytest.raises(ValueError, match="must be at least 1"):
        request("ok", output_len=0)


def test_cpu_of_the_workers_descendants_counts_as_its_own(fake_peer_spec):
    """A grandchild burns 0.3 s of CPU inside each repetition and is still alive when it ends, as vLLM's engine
    processes are: counted as other CPU, every repetition would look contaminated; counted as own, the worker's
    own CPU time covers it."""
    run = run_peer(fake_peer_spec, request("burn", batches=(PeerBatch(1, 1),)), timeout_s=120)
    ncpu = os.cpu_count()
    for rep in run.repetitions:
        own_cpu_s = rep.cpu.own_share * rep.cpu.seconds * ncpu
        assert own_cpu_s >= 0.25, rep.cpu


@pytest.mark.parametrize("place", ["venv", "site-packages"])
def test_an_environment_others_may_write_is_not_run(fake_peer_spec, place):
    """bench --compare runs the peers' python from beside the checkout: only if no other user could change it."""
    site = fake_peer_spec.venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (fake_peer_spec.venv if place == "venv" else site).chmod(0o777)
    assert not fake_peer_spec.is_installed()
    assert "writable by other users" in fake_peer_spec.missing_message()
    with pytest.raises(PeerWorkerError, match="refusing the fake environment"):
        run_peer(fake_peer_spec, request("ok"))
