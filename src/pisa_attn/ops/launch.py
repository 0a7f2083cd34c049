"""Kernel launches with the per-call Python work done once per shape class.

``kernel[grid](*args, **constexprs)`` re-binds and re-specialises every argument on each call (tens
of microseconds with many arguments, more with tensor descriptors). A :class:`Launcher` does that
once per ``key`` -- whatever the caller knows determines the compiled variant (dtypes, constexprs,
alignment class) -- keeps the compiled kernel, and afterwards launches it directly.

Tensor descriptors are passed as :class:`Desc` (base tensor, shape, strides): the launcher encodes
the TMA descriptor from those on every call, so only the first call needs a full
``TensorDescriptor`` (to specialise on its block shape and layout).

Where the installed Triton's launcher layout is known (:data:`_DIRECT`) a cached launch calls its C
entry point itself, skipping the compiled kernel's Python wrapper (launch hooks, scratch
allocation, the runner closure). Two layouts exist: Triton 3.6 compiles one C launcher per
signature that takes the kernel's arguments inline; later releases have one generic C launcher
that takes them as a tuple, with the argument annotations and packed signature the compiled
kernel's launcher object holds (:class:`Entry` ``packed``).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import NamedTuple

import torch
import triton

from .triton._common import interpreting

# Releases whose C launch entry point's arguments are known here: a cached launch calls it directly
# (when the kernel needs no scratch memory); other releases go through the compiled kernel's public
# ``kernel[grid](...)``.
_DIRECT = triton.__version__.startswith(("3.6.", "3.9."))


class Entry(NamedTuple):
    """A cached compiled kernel: ``run(g0, g1, g2, stream, function, *prefix, *args, *tail)``, or
    with ``packed`` ``run(g0, g1, g2, stream, function, *prefix, (*args, *tail))``."""

    run: object
    function: object
    prefix: tuple
    tail: tuple
    kernel: object
    packed: bool = False

    def launch(self, g0, g1, g2, stream, args):
        if self.packed:
            self.run(g0, g1, g2, stream, self.function, *self.prefix, (*args, *self.tail))
        else:
            self.run(g0, g1, g2, stream, self.function, *self.prefix, *args, *self.tail)


class Desc(NamedTuple):
    """What a compiled kernel's launcher reads of a host tensor descriptor."""

    base: torch.Tensor
    shape: list
    strides: list
    padding: str = "zero"
    # what later releases' descriptor encoders also read (as :class:`bound._PtrDesc` has them)
    round_f32_to_tf32: bool = False
    element_strides: list | None = None
    pixel_box_lower_corner: list | None = None
    pixel_box_upper_corner: list | None = None


class Launcher:
    """Launch ``fn`` (a ``triton.jit``/``gluon.jit`` function) through a cache of compiled kernels."""

    def __init__(self, fn):
        self.fn = fn
        self._cache: dict = {}
        params = list(inspect.signature(fn.fn).parameters.values())
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def cached(self, key, args: tuple) -> bool:
        """Whether a launch of ``key`` with ``args`` finds its compiled kernel."""
        return _full_key(key, args) in self._cache

    def __call__(self, key, grid, args: tuple, constexprs: dict, *, full_args=None, **options):
        """Launch on ``grid`` (1 to 3 ints) on the current stream of ``args[0]``'s device. ``args``
        are the runtime arguments in order (``Desc`` for tensor descriptors); ``full_args``, if
        given, replaces them on the first (compiling) call -- e.g. with ``TensorDescriptor``s."""
        # A compiled kernel is specialised on its pointers' element types: they are part of the key
        # whatever the caller's key says (an fp32 partial output and a bf16 one are two kernels).
        key = _full_key(key, args)
        hit = None if interpreting() else self._cache.get(key)
        if hit is None:
            rec = _recorder()
            if rec is not None:
                rec.refuse(f"{getattr(self.fn, '__name__', 'a kernel')} launched without a cached kernel")
            kernel = self.fn[grid](*(full_args if full_args is not None else args), **constexprs, **options)
            if not interpreting() and hasattr(kernel, "__getitem__"):
                self._cache[key] = self._entry(kernel, constexprs, len(args))
            return
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        dev = args[0].base.device if isinstance(args[0], Desc) else args[0].device
        stream = torch._C._cuda_getCurrentRawStream(dev.index) if dev.type == "cuda" else 0
        try:
            hit.launch(grid[0], g1, g2, stream, args)
        except TypeError:
            if not hit.prefix:
                raise
            # The C entry point parses its arguments before launching: a layout this Triton does
            # not have launches nothing, and the public path serves this kernel from now on.
            self._cache[key] = hit = self._entry(hit.kernel, None, 0, direct=False, tail=hit.tail)
            hit.launch(grid[0], g1, g2, stream, args)
        rec = _recorder()
        if rec is not None:
            rec.add(hit, grid, args)

    def _entry(self, kernel, constexprs: dict | None, n_args: int, direct: bool | None = None, tail=None):
        if direct is None:
            direct = _DIRECT
        if tail is None:
            tail = tuple(constexprs.get(n, self._defaults.get(n)) for n in self._names[n_args:])
        kernel._init_handles()
        launcher = kernel.run
        if (direct and getattr(launcher, "global_scratch_size", 1) == 0
                and getattr(launcher, "profile_scratch_size", 1) == 0
                and not getattr(launcher, "gsan_enabled", False) and hasattr(launcher, "launch")):
            coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
            if hasattr(launcher, "arg_annotations") and hasattr(launcher, "kernel_signature"):
                # The generic entry point's fixed arguments after (grid, stream, function):
                # cooperative grid, programmatic dependent launch, kernel metadata, launch metadata,
                # enter and exit hooks, global and profile scratch, argument annotations, signature.
                prefix = (coop, pdl, kernel.packed_metadata, None, None, None, None, None,
                          launcher.arg_annotations, launcher.kernel_signature)
                return Entry(launcher.launch, kernel.function, prefix, tail, kernel, packed=True)
            # Triton 3.6's per-signature entry point: cooperative grid, programmatic dependent
            # launch, global and profile scratch, kernel metadata, launch metadata, enter and exit
            # hooks, then the arguments.
            prefix = (coop, pdl, None, None, kernel.packed_metadata, None, None, None)
            return Entry(launcher.launch, kernel.function, prefix, tail, kernel)

        def run(g0, g1, g2, stream, function, *args):
            kernel[(g0, g1, g2)](*args, stream=stream)

        return Entry(run, None, (), tail, kernel)


_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63


def _full_key(key, args: tuple) -> tuple:
    # Triton specialises a pointer on its 16-byte alignment too: a kernel compiled for an aligned
    # buffer must not serve an unaligned slice of a workspace. It types an int by its value (i32;
    # i64 past 2^31, u64 from 2^63), do_not_specialize or not, and the launch of an i32 kernel
    # truncates a wider value silently (a batch stride past 2^31 elements). A loaded kernel's
    # function handle belongs to one device: another device's launch needs its own.
    ptrs, wide, dev = [], [], None
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            ptrs.append((a.dtype, a.data_ptr() % 16 == 0))
            dev = a.device if dev is None else dev
        elif isinstance(a, Desc):
            ptrs.append(a.base.dtype)
            dev = a.base.device if dev is None else dev
        elif type(a) is int and not _I32_MIN <= a <= _I32_MAX:
            wide.append((i, a >= _U64_MIN))
    return key, tuple(ptrs), tuple(wide), dev


# The recorder of :mod:`pisa_attn.ops.bound` while a planned run is being recorded, per thread (two
# threads recording at once, e.g. one per GPU, must not see or restore each other's).
_LOCAL = threading.local()


def _recorder():
    return getattr(_LOCAL, "recorder", None)


@contextlib.contextmanager
def recording(rec):
    """Every cached launch of this thread in this block is reported to ``rec.add(entry, grid,
    args)``; a launch that is not cached (it compiles, or the interpreter runs it) to
    ``rec.refuse(why)``."""
    prev, _LOCAL.recorder = _recorder(), rec
    try:
        yield rec
    finally:
        _LOCAL.recorder = prev


def unrecordable(why: str) -> None:
    """A launch outside the launchers (an autotuner, a kernel called directly): a recorded run
    could not replay it."""
    rec = _recorder()
    if rec is not None:
        rec.refuse(why)


def spec_class(*xs) -> tuple:
    """What Triton specialises a compiled kernel on, for these arguments: 16-byte alignment of
    tensors' data, and for integers whether they are 1 or multiples of 16 (strides, lengths)."""
    return tuple(x.data_ptr() % 16 == 0 if isinstance(x, torch.Tensor) else (x == 1, x % 16 == 0) for x in xs)
