"""The stub completions server, started once per module and reset for every test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from leanlm.analysis.peer_process import PeerSpec
from tests.analysis.stub_server import StubState, build_app, serve_in_thread


@pytest.fixture(scope="module")
def _stub_server():
    state = StubState()
    with serve_in_thread(build_app(state)) as url:
        yield url, state


@pytest.fixture
def stub(_stub_server):
    """(base URL, StubState) of a running stub server with a fresh state."""
    url, state = _stub_server
    state.reset()
    return url, state


@pytest.fixture(scope="session")
def smollm_f32():
    """The default model through LLM in float32 on CPU, loaded once (eval and task tests share it)."""
    from leanlm.llm import LLM

    return LLM(dtype="float32", device="cpu", progress=False)


@pytest.fixture
def fake_peer_spec(tmp_path) -> PeerSpec:
    """A peer 'environment' whose python is this interpreter, running tests/analysis/fake_peer_worker.py."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    return PeerSpec("fake", tmp_path, Path(__file__).with_name("fake_peer_worker.py"), "make peers-fake")
