"""Every architecture LeanLM runs, by HF model_type. Adding one: its module beside this one, and a line here."""

from __future__ import annotations

from leanlm.config.architectures.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from leanlm.config.architectures.gemma import GEMMA2, GEMMA3
from leanlm.config.architectures.llama import LLAMA, MISTRAL
from leanlm.config.architectures.mixtral import MIXTRAL
from leanlm.config.architectures.olmoe import OLMOE
from leanlm.config.architectures.phi3 import PHI3
from leanlm.config.architectures.qwen2 import QWEN2, QWEN2_MOE
from leanlm.config.architectures.qwen3 import QWEN3, QWEN3_MOE
from leanlm.config.architectures.spec import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        LLAMA,
        MISTRAL,
        QWEN2,
        MIXTRAL,
        QWEN2_MOE,
        OLMOE,
        QWEN3,
        QWEN3_MOE,
        GEMMA2,
        GEMMA3,
        PHI3,
        DEEPSEEK_V2,
        DEEPSEEK_V3,
    )
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def get_architecture(model_type: str) -> Architecture:
    """The Architecture of an HF model_type; a ValueError listing what is supported for any other."""
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise ValueError(
            f"architecture {model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def by_gguf_name(gguf_name: str) -> Architecture | None:
    """The Architecture llama.cpp calls `gguf_name` (general.architecture), or None."""
    return next((a for a in ARCHITECTURES.values() if a.gguf_name and a.gguf_name == gguf_name), None)
