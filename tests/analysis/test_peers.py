"""The llama.cpp peer: its command line, how failures to start are reported, and a real run when it is built."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from leanlm.analysis.load_generator import LoadConfig, run_load_sync
from leanlm.analysis.peers import LlamaServer, LlamaServerConfig, PeerUnavailable, find_llama_server
from leanlm.formats.gguf import open_gguf
from leanlm.formats.gguf.config import gguf_model_config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_command_gives_every_slot_its_context(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    config = LlamaServerConfig(gguf, parallel=4, ctx_per_slot=512, threads=2, port=9000, extra_args=("--x",))
    cmd = config.command(Path("/bin/llama-server"))
    assert cmd[:3] == ["/bin/llama-server", "--model", str(gguf)]
    flags = dict(zip(cmd, cmd[1:]))  # each flag -> the word after it
    assert flags["--parallel"] == "4" and flags["--ctx-size"] == "2048" and flags["--port"] == "9000"
    assert flags["--threads"] == "2" and flags["--threads-batch"] == "2"
    assert "--cont-batching" in cmd and "--no-kv-unified" in cmd and cmd[-1] == "--x"
    assert config.url == "http://127.0.0.1:9000"
    with pytest.raises(ValueError, match="parallel must be at least 1"):
        LlamaServerConfig(gguf, parallel=0)
    with pytest.raises(ValueError, match="does not exist"):
        LlamaServerConfig(tmp_path / "missing.gguf")


def test_a_server_that_dies_while_starting_is_reported_with_its_log(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'cannot load model' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = LlamaServer(LlamaServerConfig(gguf, binary=fake, port=free_port(), startup_timeout_s=10))
    with pytest.raises(PeerUnavailable, match="exited with status 3(.|\n)*cannot load model"):
        server.start()
    with pytest.raises(PeerUnavailable, match="not executable"):
        LlamaServer(LlamaServerConfig(gguf, binary=tmp_path / "nope")).start()


@pytest.mark.skipif(
    find_llama_server() is None, reason="llama.cpp's llama-server is not built (benchmarks/build_llama_server.sh)"
)
def test_real_llama_server_streams_exactly_the_requested_tokens(smollm_path):
    eos_token_ids = gguf_model_config(open_gguf(smollm_path)).eos_token_ids
    # One thread: OpenMP workers spin at barriers, and on a small busy machine two of them can stall for seconds.
    config = LlamaServerConfig(smollm_path, parallel=2, ctx_per_slot=256, threads=1, port=free_port())
    with LlamaServer(config) as server:
        load = LoadConfig(url=server.url, model="smollm2", num_requests=4, output_len=8, eos_token_ids=eos_token_ids)
        prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]
        result = run_load_sync(load, prompts, progress=False)
    assert result.errors == []
    for record in result.records:
        assert record.is_usage_reported and record.num_output_tokens == 8  # the EOS bias held
        assert record.num_prompt_tokens >= 4 and record.text
        assert 1 <= len(record.chunk_s) <= 8 and record.ttft_s > 0
    assert result.total_output_tokens == 32


def test_a_built_llama_server_others_may_write_is_not_run(tmp_path, monkeypatch):
    from leanlm.analysis import peers

    binary = tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    monkeypatch.setattr(peers, "BUILT_LLAMA_SERVER", binary)
    tmp_path.chmod(0o700)
    assert find_llama_server() == binary
    (tmp_path / "llama.cpp").chmod(0o777)  # another user could put their own binary there
    with pytest.raises(PeerUnavailable, match="refusing to run .*writable by other users"):
        find_llama_server()
