"""Where the peers' model files live, and that a build is written once, whole or not at all."""

from __future__ import annotations

import pytest

from leanlm.analysis import peer_models
from leanlm.analysis.peers import PEERS_DIR


def test_cache_names_follow_the_model():
    assert peer_models.model_slug("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert peer_models.model_slug("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4_1"
    assert peer_models.model_slug("/models/My-Model/") == "my-model"
    assert peer_models.dense_dir("smollm2-135m-instruct") == PEERS_DIR / "smollm2-135m-instruct-dense"
    assert peer_models.openvino_dir("x", "int4") == PEERS_DIR / "x-ov-int4"
    with pytest.raises(ValueError, match="unknown OpenVINO weight format 'int3'"):
        peer_models.openvino_dir("x", "int3")


def test_a_build_is_written_once_and_a_failed_one_leaves_nothing(tmp_path):
    calls = []

    def build(out):
        calls.append(out)
        (out / "done.txt").write_text("ok")

    target = tmp_path / "model-dense"
    assert peer_models._build_once(target, "done.txt", build) == target
    assert peer_models._build_once(target, "done.txt", build) == target  # cached
    assert len(calls) == 1 and (target / "done.txt").read_text() == "ok"

    def broken(out):
        (out / "half.bin").write_text("x")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        peer_models._build_once(tmp_path / "other", "done.txt", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-dense"]
