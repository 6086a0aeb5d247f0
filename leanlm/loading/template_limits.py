"""Size bounds for chat-template values: every operation that can build a long string, a long list or a huge
number (binary operators, `~`, filters, method calls such as str.format/join/replace) is checked against the
current render's limit BEFORE it runs, from the sizes of its operands, so no single C call allocates past it.

The time limit cannot interrupt one C call ('a' ~ 'a' on two 128 MiB strings); these checks make every such call
small instead. Sizes are `weight`s: about len(str(value)), counted only up to the limit, so measuring is bounded too.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

from jinja2.sandbox import safe_range
from jinja2.utils import Namespace

MAX_RENDER_CHARS = 8 << 20  # a rendered prompt this long is far beyond any context (about 2M tokens)


class ChatTemplateError(ValueError):
    """The template itself raised (via `raise_exception`), could not be parsed, or passed a render limit."""


class ChatTemplateTooLongError(ChatTemplateError):
    """The rendered prompt itself passed the limit (the messages are too long for it)."""


class _Limits(threading.local):
    """The current render's limit (per thread: renders run in a thread pool); `is_rendering` is False while a
    template compiles, so that filters refuse to run then and jinja does not fold them into constants unchecked."""

    max_chars: int = MAX_RENDER_CHARS
    is_rendering: bool = False


limits = _Limits()
_DIGITS = re.compile(r"\d+")
_MAX_DIGITS = 12  # a width or count with more digits is past any limit (and int() of it would be slow)


def _too_big(size: int, what: str) -> None:
    limit = limits.max_chars
    if size > limit:
        raise ChatTemplateError(
            f"the chat template {what} of about {size} characters, over the {limit}-character limit; "
            f"fix the template or shorten the messages"
        )


def weight(value: Any, budget: int | None = None) -> int:
    """About len(str(value)) (a string: its length; a list: its items' weights plus separators), counted only
    until it passes `budget` (default: the limit), so a list that repeats one big string a million times (or
    nests lists of lists) is measured in bounded time."""
    if isinstance(value, str):
        return len(value)
    budget = limits.max_chars if budget is None else budget
    total, stack = 0, [value]
    while stack and total <= budget:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 4  # quotes and ', ' inside a container
        elif isinstance(item, bool) or item is None:
            total += 6
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 3  # decimal digits, bounded above
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += 2 + 2 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, Namespace):
            stack.append(object.__getattribute__(item, "_Namespace__attrs"))
        else:  # floats, Undefined, loop objects, generators: short when printed
            total += 32
    return total


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in value (past 1000, json.dumps stops with a RecursionError anyway)."""
    deepest, stack, visits = 0, [(value, 1)], 0
    while stack and visits < limits.max_chars and deepest < 1000:
        item, depth = stack.pop()
        visits += 1
        if isinstance(item, (list, tuple, dict)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _field_widths(fmt: str) -> int:
    """The sum of every number written in a format string: an upper bound on the padding its fields add."""
    runs = _DIGITS.findall(fmt)
    if any(len(run) > _MAX_DIGITS for run in runs):
        _too_big(10**_MAX_DIGITS, "formats a field")
    return sum(int(run) for run in runs)


def check_format(fmt: str, args: Iterable[Any], marker: str) -> None:
    """`fmt % args` or `fmt.format(*args)`: each field (`marker` counts them) may print the largest argument, and
    may be padded to any width written in fmt."""
    _too_big(_field_widths(fmt), "pads a value")
    widest = max((weight(a) for a in args), default=0)
    _too_big(len(fmt) + fmt.count(marker) * widest + _field_widths(fmt), "formats a string")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Before `left <operator> right` runs in a template."""
    if operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _too_big(weight(left) + weight(right), "concatenates values")
    elif operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > 4 * limits.max_chars:
                _too_big(10**_MAX_DIGITS, "computes a number")
            return
        seq, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and count > 0:
            _too_big(weight(seq, limits.max_chars // count + 1) * count, "repeats a value")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * abs(left).bit_length() > 4 * limits.max_chars:
                raise ChatTemplateError("the chat template computes a number too large to render; fix the template")
    elif operator == "%" and isinstance(left, str):
        values = right.values() if isinstance(right, dict) else right if isinstance(right, tuple) else (right,)
        check_format(left, values, "%")


def concat_values(values: Iterable[Any]) -> str:
    """`a ~ b ~ c`: the pieces' total size is checked before the string is built."""
    values = tuple(values)
    _too_big(sum(weight(v) for v in values), "concatenates values (~)")
    return "".join(map(str, values))


def concat_output(pieces: Iterable[str]) -> str:
    """The body of `{% set x %}...{% endset %}`, a macro or a call block: joined only if it fits."""
    pieces = list(pieces)
    _too_big(sum(map(len, pieces)), "builds a block")
    return "".join(pieces)


def finalize(value: Any) -> Any:
    """`{{ value }}`: a list or dict is checked before it is printed (a string's length is counted as it is)."""
    if not isinstance(value, str):
        _too_big(weight(value), "prints a value")
    return value


def check_method_call(func: Any, args: tuple, kwargs: dict) -> tuple:
    """Before a method call such as 'x'.center(n) or ', '.join(items); returns the (possibly materialized) args."""
    limit = limits.max_chars
    for value in () if func is safe_range else (*args, *kwargs.values()):  # the sandbox's range: 100k at most
        if isinstance(value, int) and value > limit:
            raise ChatTemplateError(f"the chat template passes {value} to a function (limit {limit}); fix the template")
    # The string of a bound str method; str.format is wrapped by the sandbox, which keeps it as __wrapped__.
    bound = getattr(func, "__wrapped__", func)
    owner, name = getattr(bound, "__self__", None), getattr(bound, "__name__", "")
    if not isinstance(owner, str):
        return args
    if name == "format":
        check_format(owner, (*args, *kwargs.values()), "{")
    elif name == "format_map" and args and isinstance(args[0], dict):
        check_format(owner, args[0].values(), "{")
    elif name == "join" and args:
        items = list(args[0])  # a generator is materialized once, then measured, then joined
        _too_big(weight(items) + len(items) * len(owner), "joins values")
        args = (items, *args[1:])
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = args[2] if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0 else None
        _check_replace(owner, args[0], args[1], count)
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            _too_big(len(owner) + owner.count("\t") * max(tabsize, 0), "expands tabs")
    elif name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _too_big(max(len(owner), args[0]), "pads a string")
    return args


def _check_replace(s: str, old: str, new: str, count: int | None) -> None:
    found = s.count(old) if old else len(s) + 1
    found = found if count is None else min(found, count)
    _too_big(len(s) + found * max(len(new) - len(old), 0), "replaces text")


def _filter_bound(name: str, bound: inspect.BoundArguments, value: Any) -> int | None:
    """The size a filter's result can reach, from its arguments; None for filters whose result is no larger
    than their input (length, first, upper, trim, selectattr, ...)."""
    a = bound.arguments
    if name == "center":
        return max(weight(value), a.get("width", 80) if isinstance(a.get("width", 80), int) else 0)
    if name == "indent":
        width = a.get("width", 4)
        pad = width if isinstance(width, int) else len(str(width))
        text = str(value) if not isinstance(value, str) else value
        return len(text) + (text.count("\n") + 1) * max(pad, 0)
    if name == "replace":
        s = value if isinstance(value, str) else str(value)
        count = a.get("count")
        _check_replace(s, str(a["old"]), str(a["new"]), count if isinstance(count, int) and count >= 0 else None)
        return None
    if name == "format":
        check_format(str(value), (*a.get("args", ()), *a.get("kwargs", {}).values()), "%")
        return None
    if name == "join":
        return weight(value) + (len(value) if isinstance(value, list) else 0) * len(str(a.get("d", "")))
    if name == "wordwrap":
        return weight(value) * (1 + len(a.get("wrapstring") or "\n"))
    if name in ("batch", "slice"):
        count = a.get("linecount", a.get("slices", 0))
        return weight(value) + (count if isinstance(count, int) else 0)
    if name == "tojson":
        indent = a.get("indent")
        pad = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
        # Each item's line is indented once per level it is nested in.
        return weight(value) * (1 + max(pad, 0) * _depth(value)) if pad else weight(value)
    if name in ("escape", "e", "forceescape", "urlize", "xmlattr", "urlencode"):
        return weight(value) * 6  # '&' -> '&amp;', a link wrapped in <a href=...>
    if name in ("string", "list", "pprint", "sum", "truncate"):
        return weight(value) + len(str(a.get("end", "")))
    return None


def guard_filter(name: str, func: Callable) -> Callable:
    """`func` (a jinja filter) with its result's size checked before it runs. A list-consuming filter (join)
    gets its input materialized first, so a generator is measured and then used once."""
    signature = inspect.signature(func)
    has_pass_arg = getattr(func, "jinja_pass_arg", None) is not None
    value_idx = 1 if has_pass_arg else 0

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not limits.is_rendering:  # compile time: refuse, so jinja evaluates it at render time, with limits
            raise ChatTemplateError(f"the filter {name!r} runs only while rendering")
        if name == "join" and len(args) > value_idx and not isinstance(args[value_idx], (str, list)):
            args = (*args[:value_idx], list(args[value_idx]), *args[value_idx + 1 :])
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return func(*args, **kwargs)  # jinja reports the wrong call itself
        bound.apply_defaults()
        value = args[value_idx] if len(args) > value_idx else None
        for extra in (*args[value_idx + 1 :], *kwargs.values()):
            if isinstance(extra, int) and not isinstance(extra, bool) and extra > limits.max_chars:
                _too_big(extra, f"asks the filter {name!r} for a size")
        size = _filter_bound(name, bound, value)
        if size is not None:
            _too_big(size, f"builds, with the filter {name!r}, a value")
        return func(*args, **kwargs)

    return guarded
