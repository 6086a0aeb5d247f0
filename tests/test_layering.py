"""The package edges docs/architecture.md states, checked on the source: who may import whom, and size."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import leanlm

PACKAGE = Path(leanlm.__file__).parent
# an engine's collaborators, reached through it (`engine.scheduler`, `llm.llm_engine.model_runner`, ...)
ENGINE_INTERNALS = re.compile(
    r"engine\.(scheduler|model_runner|kv_cache_manager|output_processor|spec_decoder|executor)\b"
)
MAX_LINES = 400


def _modules(*exclude: str) -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if not any(p.is_relative_to(PACKAGE / e) for e in exclude)]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_nothing_outside_the_engine_reaches_into_it():
    offenders = []
    for path in _modules("engine"):
        inner = [m for m in _imports(path) if m.startswith("leanlm.engine.")]
        touched = ENGINE_INTERNALS.findall(path.read_text())
        if inner or touched:
            offenders.append(f"{path.relative_to(PACKAGE)}: {inner + touched}")
    assert not offenders, "import from leanlm.engine and use LLMEngine's methods:\n" + "\n".join(offenders)


def test_loading_and_model_do_not_import_compress():
    offenders = [
        str(path.relative_to(PACKAGE))
        for sub in ("loading", "model", "kernels", "config")
        for path in sorted((PACKAGE / sub).rglob("*.py"))
        if any(m == "leanlm.compress" or m.startswith("leanlm.compress.") for m in _imports(path))
    ]
    assert not offenders


def _importers(subs: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    """Modules under `subs` that import any of the `banned` packages (or their modules)."""
    return [
        f"{path.relative_to(PACKAGE)}: {sorted(hit)}"
        for sub in subs
        for path in sorted((PACKAGE / sub).rglob("*.py"))
        if (hit := {m for m in _imports(path) if any(m == b or m.startswith(b + ".") for b in banned)})
    ]


def test_formats_sit_between_the_model_and_its_users():
    """A checkpoint format reads and writes models: it builds on config, loading and model, and nothing that
    compresses, trains or serves them reaches into it the other way round (they import leanlm.formats)."""
    upward = ("leanlm.compress", "leanlm.train", "leanlm.engine", "leanlm.server", "leanlm.cli", "leanlm.llm")
    assert not _importers(("formats",), upward), "formats/ builds on config, loading and model only"
    below = ("loading", "model", "kernels", "config")
    assert not _importers(below, ("leanlm.formats",)), "the runtime layers never import a checkpoint format"


def test_compress_never_imports_train():
    """train/ builds on compress (its configs subclass MethodConfig), never the reverse."""
    assert not _importers(("compress",), ("leanlm.train",))


# The layers docs/architecture.md draws, bottom first: each imports only the layers at or below its own. The
# side packages (compress, train, analysis, data, tool_calls and the request-side parameter modules) are
# checked by the tests above, not placed here.
LAYERS = (
    ("config", "loading"),  # model files and names -> ModelConfig, weights, tokenizer; the architectures' tables
    ("kernels",),  # native CPU kernels and their PyTorch references
    ("model",),  # the decoder over flat token batches, runtime weight formats
    ("formats",),  # checkpoint formats, one loader
    ("engine",),  # LLMEngine and its collaborators
    ("parallel",),  # model parallelism inside one engine (torch.distributed)
    ("llm",),  # LLM, the offline entry point
    ("server",),  # `leanlm serve`
    ("fleet",),  # replicas behind a cache-aware front
    ("cli",),
)


def test_no_layer_imports_one_above_it():
    """Upward edges a review found (kernels -> model for the int8 activation numerics; loading -> config -> model
    for the architecture tables; llm -> parallel -> server -> llm through the data-parallel front) stay gone."""
    offenders = []
    for level, subs in enumerate(LAYERS):
        above = tuple(f"leanlm.{name}" for upper in LAYERS[level + 1 :] for name in upper)
        offenders += _importers_of_layer(subs, above)
    assert not offenders, "a layer imports one above it:\n" + "\n".join(offenders)


def _importers_of_layer(subs: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    """_importers over packages and single-module layers (llm.py) alike."""
    packages = tuple(s for s in subs if (PACKAGE / s).is_dir())
    found = _importers(packages, banned)
    for single in (s for s in subs if (PACKAGE / f"{s}.py").is_file()):
        hit = {m for m in _imports(PACKAGE / f"{single}.py") if any(m == b or m.startswith(b + ".") for b in banned)}
        found += [f"{single}.py: {sorted(hit)}"] if hit else []
    return found


def test_the_fleet_uses_only_the_servers_public_pieces():
    """The fleet imports `leanlm.server` itself (its __init__ names the pieces other HTTP processes share), never a
    server module, and neither the engine, the model nor LLM: a front process loads no model."""
    inner = [
        f"{path.relative_to(PACKAGE)}: {m}"
        for path in sorted((PACKAGE / "fleet").rglob("*.py"))
        for m in _imports(path)
        if m.startswith("leanlm.server.")
    ]
    assert not inner, "import from leanlm.server, not its modules:\n" + "\n".join(inner)
    engine_side = ("leanlm.engine", "leanlm.model", "leanlm.llm", "leanlm.formats", "leanlm.kernels")
    assert not _importers(("fleet",), engine_side)


def test_no_module_passes_the_size_where_it_should_be_split():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in _modules()}
    assert not {name: n for name, n in sizes.items() if n > MAX_LINES}
