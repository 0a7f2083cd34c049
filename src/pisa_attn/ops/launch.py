"""Kernel launches with the per-call Python work done once per shape class.

``kernel[grid](*args, **constexprs)`` re-binds and re-specialises every argument on each call (tens
of microseconds with many arguments, more with tensor descriptors). A :class:`Launcher` does that
once per ``key`` -- whatever the caller knows determines the compiled variant (dtypes, constexprs,
alignment class) -- keeps the compiled kernel, and afterwards launches it directly.

Tensor descriptors are passed as :class:`Desc` (base tensor, shape, strides): the launcher encodes
the TMA descriptor from those on every call, so only the first call needs a full
``TensorDescriptor`` (to specialise on its block shape and layout).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from .triton._common import interpreting


class Desc(NamedTuple):
    """What a compiled kernel's launcher reads of a host tensor descriptor."""

    base: torch.Tensor
    shape: list
    strides: list
    padding: str = "zero"


class Launcher:
    """Launch ``fn`` (a ``triton.jit``/``gluon.jit`` function) through a cache of compiled kernels."""

    def __init__(self, fn):
        self.fn = fn
        self._cache: dict = {}
        params = list(inspect.signature(fn.fn).parameters.values())
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def __call__(self, key, grid, args: tuple, constexprs: dict, *, full_args=None, **options):
        """Launch on ``grid``. ``args`` are the runtime arguments in order (``Desc`` for tensor
        descriptors); ``full_args``, if given, replaces them on the first (compiling) call --
        e.g. with full ``TensorDescriptor`` objects."""
        hit = None if interpreting() else self._cache.get(key)
        if hit is None:
            kernel = self.fn[grid](*(full_args if full_args is not None else args), **constexprs, **options)
            if not interpreting() and hasattr(kernel, "__getitem__"):
                tail = tuple(constexprs.get(n, self._defaults.get(n)) for n in self._names[len(args):])
                self._cache[key] = (kernel, tail)
            return
        kernel, tail = hit
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        kernel[grid3](*args, *tail, stream=torch.cuda.current_stream().cuda_stream)
