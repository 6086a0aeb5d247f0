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
import re
import sys
import threading
import time
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_CHARS = 8 << 20  # a rendered prompt this long is far beyond any context (about 2M tokens)
RENDER_TIMEOUT_S = 2.0  # real templates render in milliseconds


class ChatTemplateError(ValueError):
    """The template itself raised (via `raise_exception`), could not be parsed, or passed a render limit."""


class _Limits(threading.local):
    """The current render's limit on value and output sizes (per thread: renders run in a thread pool)."""

    max_chars: int = MAX_RENDER_CHARS


_limits = _Limits()
_WIDE_FORMAT = re.compile(r"%[-+ #0]*(\d+)")  # the width of a %-format: '%1000000000s' pads to a gigabyte


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, plus size checks on the operations that build large values in one C call."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        limit = _limits.max_chars
        if operator == "*":
            seq, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > limit:
                raise ChatTemplateError(f"the chat template builds a value over the {limit}-character limit")
        elif operator == "**":
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and abs(left) > 1
                and right * abs(left).bit_length() > 4 * limit
            ):
                raise ChatTemplateError("the chat template computes a number too large to render")
        elif operator == "%" and isinstance(left, str):
            if any(int(width) > limit for width in _WIDE_FORMAT.findall(left)):
                raise ChatTemplateError(f"the chat template pads a value over the {limit}-character limit")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        # 'x'.ljust(10**9), 'x'.center(...), '{:>1000000000}'.format(...): no argument may ask for more.
        limit = _limits.max_chars
        # The string of a bound str.ljust, or of str.format (which the sandbox wraps, keeping it as __wrapped__).
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        for value in (owner, *args, *kwargs.values()):
            if isinstance(value, int) and value > limit:
                raise ChatTemplateError(f"the chat template passes {value} to a function (limit {limit})")
            if isinstance(value, str) and any(int(w) > limit for w in re.findall(rf"\d{{{len(str(limit))},}}", value)):
                raise ChatTemplateError(f"the chat template passes a format wider than the {limit}-character limit")
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
    env.filters["tojson"] = _tojson
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

    previous_trace, previous_limit = sys.gettrace(), _limits.max_chars
    _limits.max_chars = max_chars
    sys.settrace(check_time)  # this thread only
    try:
        pieces, num_chars = [], 0
        for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            num_chars += len(piece)
            if num_chars > max_chars:
                raise ChatTemplateError(f"the model's chat template rendered more than {max_chars} characters")
            pieces.append(piece)
        return "".join(pieces)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template failed to render: {e}") from e
    except (MemoryError, OverflowError, RecursionError) as e:
        raise ChatTemplateError(f"the model's chat template failed to render: {type(e).__name__}") from e
    finally:
        sys.settrace(previous_trace)
        _limits.max_chars = previous_limit
