"""A planned run's launches, bound once and replayed with only the call's tensors swapped in.

A planned run issues the same short sequence of launches every time: the same compiled kernels,
grids and arguments, except the pointers of the call's own tensors (q, k, v, the output, the
first-order weights, the device copy of the always-exact key blocks). :func:`record` runs the
stages once under a recorder that collects every launch the
:class:`~pisa_attn.ops.launch.Launcher` s issue; :func:`bind` turns that list into one
generated Python function that calls each kernel's launcher directly with the workspace's
pointers as constants and the call's pointers read per call. Host TMA descriptors of workspace
tensors are encoded once; those of the call's tensors are encoded through Triton's own encoder
and kept by data pointer (PyTorch's caching allocator hands the same addresses back between
layers and steps), so a repeated call encodes nothing.

A run is only recorded when everything it did on the device went through cached launchers and
every tensor argument is either one of the call's tensors or lies in the plan's workspace;
anything else (a first, compiling launch, an aten op that is not a view or an allocation, an
argument derived from a call's tensor at an offset) leaves the call on the ordinary path.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

from torch import Tensor

from . import launch as _launch


class Launch(NamedTuple):
    """One recorded launch: the launcher's cache entry, its grid and its runtime arguments."""

    entry: tuple
    grid: tuple
    args: tuple


class Recorder:
    """Collects the launches of one run (see :func:`pisa_attn.ops.launch.recording`)."""

    def __init__(self):
        self.launches: list[Launch] = []
        self.ok = True
        self.why = ""

    def add(self, entry, grid, args):
        self.launches.append(Launch(entry, tuple(grid), tuple(args)))

    def refuse(self, why: str):
        if self.ok:
            self.ok, self.why = False, why


_ALLOWED_OPS = ("aten::empty", "aten::empty_strided", "aten::detach")


def _guard_mode(rec: Recorder):
    """A dispatch mode that refuses the recording when a run does device work outside the
    launchers (a copy, a fill, a reduction): replaying the launches alone would skip it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Guard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if not (func.is_view or name in _ALLOWED_OPS):
                rec.refuse(f"aten op {name} outside the launchers")
            return func(*args, **(kwargs or {}))

    return Guard()


def record(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under a recorder: (its result, the :class:`Recorder`)."""
    rec = Recorder()
    with _launch.recording(rec), _guard_mode(rec):
        res = fn(*args, **kwargs)
    return res, rec


def tensors_of(obj, seen=None) -> list[Tensor]:
    """Every tensor held by a workspace object (dataclasses, named tuples, tuples, lists)."""
    out: list[Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif hasattr(x, "__dataclass_fields__"):
            stack.extend(getattr(x, f) for f in x.__dataclass_fields__)
    return out


class _Ptr:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _PtrDesc:
    """What Triton's descriptor encoder reads of a host tensor descriptor, by pointer."""

    __slots__ = ("base", "shape", "strides", "padding", "round_f32_to_tf32", "element_strides",
                 "pixel_box_lower_corner", "pixel_box_upper_corner")

    def __init__(self, ptr: int, shape, strides, padding: str):
        self.base = _Ptr(ptr)
        self.shape, self.strides, self.padding = list(shape), list(strides), padding
        self.round_f32_to_tf32 = False
        self.element_strides = self.pixel_box_lower_corner = self.pixel_box_upper_corner = None


def _tensordesc_route(entry):
    """(raw launcher, per-descriptor metadata, encoder) when the entry's launcher wraps a C entry
    point with Triton's descriptor expansion and every descriptor has TMA metadata; else None
    (descriptors then go through the wrapper, encoded per call)."""
    if not entry.prefix:
        return None
    fn = entry.run
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return None
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    raw, meta = free.get("launcher"), free.get("tensordesc_meta")
    enc = free.get("make_tensordesc_arg") or fn.__globals__.get("make_tensordesc_arg")
    if raw is None or not meta or enc is None or any(m is None for m in meta):
        return None
    n = len(inspect.signature(enc).parameters)
    if n == 2:
        return raw, list(meta), enc
    if n == 3:
        return raw, list(meta), lambda arg, m: enc(arg, m, None)
    return None


def _pack(exprs: list[str], ns: dict, prefix: str) -> list[str]:
    """Runs of constant arguments as one star-unpacked tuple each (fewer name lookups per call)."""
    out, run = [], []

    def flush():
        if len(run) > 1:
            name = f"{prefix}{len(out)}"
            ns[name] = tuple(ns[e] for e in run)
            out.append(f"*{name}")
        else:
            out.extend(run)
        run.clear()

    for e in exprs:
        if e.startswith("c") and e in ns:
            run.append(e)
        else:
            flush()
            out.append(e)
    flush()
    return out


class _DescCache:
    """Encoded TMA descriptors of one call-tensor slot, by data pointer (shape and strides are
    fixed by the program)."""

    __slots__ = ("shape", "strides", "padding", "meta", "enc", "cache")
    LIMIT = 64

    def __init__(self, shape, strides, padding, meta, enc):
        self.shape, self.strides, self.padding, self.meta, self.enc = shape, strides, padding, meta, enc
        self.cache: dict[int, tuple] = {}

    def __call__(self, ptr: int) -> tuple:
        r = self.cache.get(ptr)
        if r is None:
            if len(self.cache) >= self.LIMIT:
                self.cache.clear()
            r = self.cache[ptr] = tuple(self.enc(_PtrDesc(ptr, self.shape, self.strides, self.padding), self.meta))
        return r


SLOTS = ("q", "k", "v", "out", "alpha", "lse", "keep")


def bind(launches: list[Launch], slot_tensors: tuple, workspace: list[Tensor]):
    """The generated replay function ``replay(stream, q, k, v, out, alpha, lse, keep)`` of ``launches``
    recorded with ``slot_tensors`` (:data:`SLOTS`; any may be None) as the call's tensors;
    None when an argument is neither a call's tensor, in ``workspace``, nor a plain value, or when
    nothing was recorded (a run launches at least one kernel)."""
    if not launches:
        return None
    slot_ptr = {}
    for i, t in enumerate(slot_tensors):
        if t is not None:
            p = t.data_ptr()
            if p in slot_ptr:  # aliased call tensors: a replay could not tell them apart
                return None
            slot_ptr[p] = i
    ranges = []
    for t in workspace:
        s = t.untyped_storage()
        ranges.append((s.data_ptr(), s.data_ptr() + s.nbytes()))

    def in_ws(p: int) -> bool:
        return any(lo <= p < hi for lo, hi in ranges)

    ns: dict = {"_Desc": _launch.Desc}
    lines = []
    used = set()
    for li, (entry, grid, args) in enumerate(launches):
        direct = bool(entry.prefix)
        route = _tensordesc_route(entry) if any(isinstance(a, _launch.Desc) for a in args) else None
        n_desc = 0
        exprs = []
        for ai, a in enumerate(args):
            name = f"c{li}_{ai}"
            if isinstance(a, Tensor):
                p = a.data_ptr()
                if p in slot_ptr:
                    s = slot_ptr[p]
                    used.add(s)
                    exprs.append(f"p{s}" if direct else f"s{s}")
                elif in_ws(p):
                    ns[name] = p if direct else a
                    exprs.append(name)
                else:
                    return None
            elif isinstance(a, _launch.Desc):
                p = a.base.data_ptr()
                meta = None
                if route is not None:
                    if n_desc >= len(route[1]):
                        return None
                    meta = route[1][n_desc]
                n_desc += 1
                if p in slot_ptr:
                    s = slot_ptr[p]
                    used.add(s)
                    if route is not None:
                        ns[name] = _DescCache(a.shape, a.strides, a.padding, meta, route[2])
                        exprs.append(f"*{name}(p{s})")
                    else:
                        ns[name + "s"], ns[name + "t"] = list(a.shape), list(a.strides)
                        exprs.append(f"_Desc(s{s}, {name}s, {name}t, {a.padding!r})")
                elif in_ws(p):
                    if route is not None:
                        ns[name] = tuple(route[2](_PtrDesc(p, a.shape, a.strides, a.padding), meta))
                        exprs.append(f"*{name}")
                    else:
                        ns[name] = a
                        exprs.append(name)
                else:
                    return None
            else:
                ns[name] = a
                exprs.append(name)
        if route is not None and n_desc != len(route[1]):
            return None
        exprs = _pack(exprs, ns, f"k{li}_")
        g = tuple(grid) + (1,) * (3 - len(grid))
        ns[f"run{li}"] = route[0] if route is not None else entry.run
        ns[f"fn{li}"] = entry.function
        ns[f"pre{li}"] = tuple(entry.prefix)
        ns[f"tail{li}"] = tuple(entry.tail)
        call_args = f"{', '.join(exprs)}, *tail{li}"
        if entry.packed:  # the generic entry point takes the kernel's arguments as one tuple
            call_args = f"({call_args})"
        lines.append(f"    run{li}({g[0]}, {g[1]}, {g[2]}, stream, fn{li}, *pre{li}, {call_args})")
    head = [f"    p{s} = s{s}.data_ptr()" for s in sorted(used)]
    src = "def replay(stream, s0, s1, s2, s3, s4, s5, s6):\n" + "\n".join(head + lines or ["    pass"]) + "\n"
    exec(compile(src, "<pisa_attn bound run>", "exec"), ns)  # noqa: S102 - generated from recorded launches
    replay = ns["replay"]
    replay.source = src
    replay.n_launches = len(launches)
    return replay
