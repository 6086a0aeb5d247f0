"""Render a model's Jinja chat template the way HF `apply_chat_template` does, in a sandbox with limits.

Same environment knobs as HF (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `tojson`), so the
templates shipped in GGUF metadata and `tokenizer_config.json` render byte-for-byte like the reference.

A template comes from a model file, so it is untrusted code: the sandbox stops attribute escapes, and the
limits here stop it from rendering for ever or without end (`'a' * 10**9`, nested loops): a render stops with
a ChatTemplateError past `timeout_s` or `max_chars`, and no single operation may build a value larger than
`max_chars`.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import loopcontrols
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment

from leanlm.loading import template_limits
from leanlm.loading.template_limits import MAX_RENDER_CHARS, ChatTemplateError, ChatTemplateTooLongError, limits

__all__ = [
    "MAX_RENDER_CHARS",
    "RENDER_TIMEOUT_S",
    "ChatTemplateError",
    "ChatTemplateTooLongError",
    "render_chat_template",
]

RENDER_TIMEOUT_S = 2.0  # real templates render in milliseconds


class _LimitedCodeGenerator(CodeGenerator):
    """Jinja's compiler, but `a ~ b` calls the environment (jinja joins it inline, where nothing can check it)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, plus size checks (template_limits.py) before every operation that can build a large value
    in one C call: the binary operators, `~`, block bodies, printed values, filters and method calls."""

    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=template_limits.finalize, **options)
        self.filters = {name: template_limits.guard_filter(name, f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs; no chat template needs it

    def concat(self, pieces) -> str:  # jinja's `concat = "".join`, for block bodies, macros and call blocks
        return template_limits.concat_output(pieces)

    def concat_values(self, values) -> str:
        return template_limits.concat_values(values)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        template_limits.check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        # 'x'.ljust(10**9), '{:>1000000000}'.format(...), ', '.join(...): checked from the arguments first.
        args = template_limits.check_method_call(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON like HF renders it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    env = _LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = template_limits.guard_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}") from e


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    *,
    max_chars: int = MAX_RENDER_CHARS,
    timeout_s: float = RENDER_TIMEOUT_S,
    **variables: Any,
) -> str:
    """Render `source` for `messages`; `variables` (bos_token, eos_token, tools, ...) reach the template.
    Raises ChatTemplateError when the output passes max_chars or the render takes longer than timeout_s."""
    template = _compile(source)
    deadline = time.monotonic() + timeout_s

    def check_time(frame, event: str, arg: Any):
        # A trace function sees every line the template's compiled code runs, loops without output included.
        if time.monotonic() > deadline:
            raise ChatTemplateError(f"the model's chat template took longer than {timeout_s} s to render")
        return check_time

    previous = sys.gettrace(), limits.max_chars, limits.is_rendering
    limits.max_chars, limits.is_rendering = max_chars, True
    sys.settrace(check_time)  # this thread only
    try:
        pieces, num_chars = [], 0
        for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            num_chars += len(piece)
            if num_chars > max_chars:
                raise ChatTemplateTooLongError(f"the model's chat template rendered more than {max_chars} characters")
            pieces.append(piece)
        return "".join(pieces)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template failed to render: {e}") from e
    except (MemoryError, OverflowError, RecursionError) as e:
        raise ChatTemplateError(f"the model's chat template failed to render: {type(e).__name__}") from e
    finally:
        sys.settrace(previous[0])
        limits.max_chars, limits.is_rendering = previous[1:]
