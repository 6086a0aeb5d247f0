"""Render a model's Jinja chat template the way HF `apply_chat_template` does, in a sandbox.

Same environment knobs as HF (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `tojson`), so the
templates shipped in GGUF metadata and `tokenizer_config.json` render byte-for-byte like the reference.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template itself raised (via `raise_exception`) or could not be parsed."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON like HF renders it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}") from e


def render_chat_template(
    source: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
) -> str:
    """Render `source` for `messages`; `variables` (bos_token, eos_token, tools, ...) reach the template."""
    template = _compile(source)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template failed to render: {e}") from e
