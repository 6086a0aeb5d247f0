"""The native linear kernels' argument specs and their one caller: each kernel declares its tensors (name, dtype,
shape in symbols such as N, K, K/8, K/G) once, and a KernelSpec turns that into the fast check (compiled to one
boolean expression), the slow path that says what is wrong, the policy's row check, and the ctypes call of a row kernel
(output rows, the K == 0 shortcut, pointers, the return code)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from leanlm.kernels.build import NativeKernel

# Below this many weight bytes one thread does the whole matrix: waking the OpenMP pool costs a few
# microseconds, about what a second core saves on a small matrix.
MIN_PARALLEL_BYTES = 64 * 1024
ROWS = "..."  # a shape's first entry for the activation rows x [..., K]: any leading dims, M = x.numel() // K
_DIM = re.compile(r"^([A-Za-z_]\w*)(?:/(\d+|[A-Za-z_]\w*))?$")  # "S", "S/8" or "S/G"


@dataclass(frozen=True)
class Arg:
    """One tensor a kernel reads: contiguous, on the CPU, of `dtype` and `shape` (symbols, "S/c" for S / c with
    c | S, "S/T" likewise for a symbol T; ROWS first for the activation rows); None allowed when `optional`."""

    name: str
    dtype: torch.dtype
    shape: tuple[str, ...]
    optional: bool = False

    @property
    def is_rows(self) -> bool:
        return self.shape[:1] == (ROWS,)

    def dims(self) -> list[tuple[int, str, int | str | None]]:
        """(index into t.shape, symbol, divisor) per dim; negative indexes for rows (they follow the leading dims)."""
        dims = self.shape[1:] if self.is_rows else self.shape
        out = []
        for i, dim in enumerate(dims):
            m = _DIM.match(dim)
            if m is None:
                raise ValueError(f"{self.name}: cannot read the shape entry {dim!r}")
            div = m.group(2)
            out.append((i - len(dims) if self.is_rows else i, m.group(1), int(div) if div and div.isdigit() else div))
        return out

    def doc(self) -> str:
        return "[" + ", ".join(self.shape) + "]"


@dataclass(frozen=True)
class Rule:
    """A condition on symbols the kernel needs beyond shapes (group sizes); `message` is formatted with them."""

    symbols: tuple[str, ...]
    ok: Callable[..., bool]
    message: str


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KernelSpec:
    """The arguments of one native kernel: `args` in its C order, then the `given` symbols the caller passes (ints
    such as a group size). Symbols are bound by the first weight (non-row, non-optional) dim naming them alone or
    as "S/c"; the rows and every later use are checked against that. A symbol divisor ("K/G") must be given.
    explain() checks in the order users can act on: each tensor's dtype, device, layout and rank, then the rules,
    then the shapes."""

    def __init__(
        self,
        kernel: NativeKernel,
        what: str,  # the kernel as errors name it ("CPU bf16 GEMV kernel")
        args: Sequence[Arg],
        given: Sequence[str] = (),
        rules: Sequence[Rule] = (),
        out_dtype: torch.dtype = torch.bfloat16,  # what linear() returns: the activations' dtype
    ) -> None:
        self.kernel, self.what, self.args, self.out_dtype = kernel, what, tuple(args), out_dtype
        self.given, self.rules = tuple(given), tuple(rules)
        self._binders: dict[str, tuple[Arg, int, int | None]] = {}
        for arg in sorted((a for a in self.args if not a.optional), key=lambda a: a.is_rows):  # weights bind first
            for i, sym, div in arg.dims():
                if sym not in self._binders and sym not in self.given and not isinstance(div, str):
                    self._binders[sym] = (arg, i, div)
        self.rows_index = next((i for i, a in enumerate(self.args) if a.is_rows), None)
        # fits(*tensors, *given): every check of explain(), as one expression (it runs ~200 times a decoded token)
        self.fits = self._compile(partial=False)
        # fits_partial: the same with any tensor allowed to be None (not checked): for policies and native calls,
        # which see only some of the tensors; the binding ones must be there
        self.fits_partial = self._compile(partial=True)

    # ------------------------------------------------------------------------------------------------ checking

    def _symbol(self, sym: str) -> str:
        if sym in self.given:
            return sym
        arg, i, div = self._binders[sym]
        return f"{arg.name}.shape[{i}]" + ("" if div is None else f" * {div}")

    def _shape_checks(self, arg: Arg) -> list[str]:
        checks = []
        for i, sym, div in arg.dims():
            binder = self._binders.get(sym)
            if binder is not None and binder[0] is arg and binder[1] == i:
                continue  # the dim that defines the symbol
            s, dim = f"({self._symbol(sym)})", f"{arg.name}.shape[{i}]"
            if div is None:
                checks.append(f"{dim} == {s}")
            else:
                d = f"({self._symbol(div)})" if isinstance(div, str) else str(div)
                guard = f"type({d}) is int and {d} > 0 and " if isinstance(div, str) else ""
                checks.append(f"{guard}{s} % {d} == 0 and {dim} == {s} // {d}")
        return checks

    def _compile(self, partial: bool) -> Callable[..., bool]:
        env: dict = {}
        kinds, shapes, optional = [], [], []
        for arg in self.args:
            n = arg.name
            env[f"_dt_{n}"] = arg.dtype
            rank = f"{n}.dim() >= {len(arg.shape) - 1}" if arg.is_rows else f"{n}.dim() == {len(arg.shape)}"
            kind = f"{n}.dtype is _dt_{n} and {n}.is_cpu and {n}.is_contiguous() and {rank}"
            shape = " and ".join(self._shape_checks(arg)) or "True"
            if arg.optional:
                optional.append(f"({n} is None or ({kind} and {shape}))")
            elif partial:
                kinds.append(f"({n} is None or ({kind}))")
                shapes.append(f"({n} is None or ({shape}))")
            else:
                kinds.append(f"{n} is not None and {kind}")
                shapes.append(shape)
        rules = []
        for j, rule in enumerate(self.rules):
            env[f"_rule{j}"] = rule.ok
            rules.append(f"_rule{j}({', '.join(self._symbol(s) for s in rule.symbols)})")
        params = ", ".join([a.name for a in self.args] + list(self.given))
        source = f"def fits({params}):\n    return " + " and ".join(kinds + rules + shapes + optional) + "\n"
        exec(compile(source, f"<KernelSpec {self.kernel.symbol}>", "exec"), env)
        return env["fits"]

    def explain(self, *values) -> None:
        """The slow path of fits(): raise a ValueError that says which tensor is wrong and how."""
        tensors, env = values[: len(self.args)], dict(zip(self.given, values[len(self.args) :], strict=True))
        for arg, t in zip(self.args, tensors, strict=True):
            want = f"a contiguous {_dtype_name(arg.dtype)} CPU tensor"
            if t is None:
                if arg.optional:
                    continue
                raise ValueError(f"{arg.name} must be {want} {arg.doc()}, not None")
            if t.dtype is not arg.dtype or not t.is_cpu or not t.is_contiguous():
                layout = "" if t.is_contiguous() else "non-contiguous "
                raise ValueError(f"{arg.name} must be {want}, not {layout}{t.dtype} on {t.device}")
            if (t.dim() < len(arg.shape) - 1) if arg.is_rows else (t.dim() != len(arg.shape)):
                raise ValueError(f"{arg.name} has shape {tuple(t.shape)}, expected {arg.doc()}")
        for sym, (arg, i, div) in self._binders.items():
            env[sym] = tensors[self.args.index(arg)].shape[i] * (div or 1)
        for rule in self.rules:
            if not rule.ok(*(env[s] for s in rule.symbols)):
                raise ValueError(rule.message.format(**env))
        for arg, t in zip(self.args, tensors, strict=True):
            if t is not None:
                self._explain_shape(arg, t, tensors, env)

    def _explain_shape(self, arg: Arg, t: torch.Tensor, tensors, env: dict) -> None:
        want, why = [], ""
        for i, sym, div in arg.dims():
            s, d = env[sym], env[div] if isinstance(div, str) else div
            if d is not None and (type(d) is not int or d <= 0 or s % d):
                shape = tuple(t.shape)
                raise ValueError(f"{arg.name} has shape {shape}, expected {arg.doc()} with {div} | {sym} = {s}")
            want.append(s if d is None else s // d)
            binder = self._binders.get(sym)
            if not why and t.shape[i] != want[-1] and binder is not None and binder[0] is not arg:
                why = f": it does not match {binder[0].name} {tuple(tensors[self.args.index(binder[0])].shape)}"
        got = tuple(t.shape)[len(t.shape) - len(want) :]
        if got != tuple(want):
            shown = "[..., " + ", ".join(map(str, want)) + "]" if arg.is_rows else str(tuple(want))
            raise ValueError(f"{arg.name} has shape {tuple(t.shape)}, expected {shown}{why}")

    def rows_fit(self, *values, max_rows: int) -> bool:
        """The policy's shape half: the tensors given fit (others may be None) and there are at most `max_rows` rows.
        Whether the kernel is loaded is the module's is_available() (which tests replace to model other CPUs)."""
        x = values[self.rows_index]
        return self.fits_partial(*values) and x.numel() <= max_rows * x.shape[-1]

    # ------------------------------------------------------------------------------------------------- calling

    def fn(self):
        """The loaded entry, or a RuntimeError that says why there is none."""
        return loaded(self.kernel, self.what)

    def linear(self, x: torch.Tensor, N: int, K: int, inputs: Sequence, ints: Sequence[int] = (), bias=None):
        """y [..., N] (out_dtype) from a row kernel fn(*inputs, y, M, N, K, *ints, threads, MIN_PARALLEL_BYTES) on
        checked arguments; inputs are tensors (passed as pointers), None (NULL) or floats, in the C order."""
        fn = self.fn()
        # (x.shape[0], N) for the usual 2-D x: building a torch.Size from x.shape[:-1] costs about a microsecond
        y = torch.empty((x.shape[0], N) if x.dim() == 2 else x.shape[:-1] + (N,), dtype=self.out_dtype)
        if K == 0:  # an empty sum: the bias alone
            return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
        tail = (y, x.numel() // K, N, K, *ints, torch.get_num_threads(), MIN_PARALLEL_BYTES)
        call(fn, self.kernel.symbol, *inputs, *tail)
        return y


def loaded(kernel: NativeKernel, what: str):
    """kernel's loaded entry, or a RuntimeError naming `what` is unavailable and why."""
    fn = kernel.fn()
    if fn is None:
        raise RuntimeError(f"{what} unavailable: {kernel.unavailable_reason}")
    return fn


def call(fn, symbol: str, *args) -> None:
    """fn(*args) with tensors passed as their data pointers; a nonzero return code is a RuntimeError (entries that
    cannot fail return void: None)."""
    rc = fn(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])
    if rc:
        raise RuntimeError(f"{symbol} failed (code {rc})")
