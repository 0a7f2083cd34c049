"""Kernel launches without a GPU, for the host path: every Launcher compiles to a fake kernel whose
C-style entry point only logs what it was launched with (grid and arguments, tensors as data
pointers), and the Triton attention kernel goes through its Launcher (fixed config). The host
work -- plan checks, launch binding, recorded replays -- runs exactly as on a GPU; no kernel runs.
"""

from __future__ import annotations

import contextlib
import os

import torch


class _Run:
    """A compiled kernel's launcher as Triton 3.6 has it: a C entry point and its metadata."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def launch(self, g0, g1, g2, stream, function, *rest):
        # rest[8:]: after the fixed arguments (cooperative grid ... exit hook)
        self.log.append((self.name, g0, g1, g2, rest[8:]))  # cheap: the host path is what is timed


class _GenericRun(_Run):
    """The same as later Triton releases have it: one generic C entry point that takes the
    kernel's arguments as a tuple after fixed arguments ending in annotations and signature."""

    arg_annotations = ("annotations",)
    kernel_signature = b"signature"

    def launch(self, g0, g1, g2, stream, function, *rest):
        assert len(rest) == 11 and rest[8:10] == (self.arg_annotations, self.kernel_signature), rest
        assert isinstance(rest[10], tuple)
        self.log.append((self.name, g0, g1, g2, rest[10]))


def entries(log: list) -> list:
    """The log as (kernel, grid, arguments), tensors and pointers as ("ptr", address)."""
    return [(n, (g0, g1, g2), tuple(_norm(a) for a in args)) for n, g0, g1, g2, args in log]


def _norm(a):
    if isinstance(a, torch.Tensor):
        return ("ptr", a.data_ptr())
    if isinstance(a, int) and not isinstance(a, bool) and a > 1 << 32:
        return ("ptr", a)  # a pointer passed as an int (a bound launch)
    return a


class _Kernel:
    def __init__(self, name: str, log: list, run_cls=_Run):
        self.run = run_cls(name, log)
        self.function = None
        self.packed_metadata = None

    def __getitem__(self, grid):
        return lambda *a, **k: None

    def _init_handles(self):
        pass


STYLES = ("per-signature", "generic")


@contextlib.contextmanager
def fake_kernels(style: str = "per-signature"):
    """Within: launches log into the yielded list instead of running (see the module docstring);
    ``style``: the launcher layout of Triton 3.6 (``per-signature``) or of later releases."""
    run_cls = {"per-signature": _Run, "generic": _GenericRun}[style]
    from pisa_attn.attention import clear_plans
    from pisa_attn.ops import launch
    from pisa_attn.ops.triton import attention as tattn

    log: list = []

    class FakeFn:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **k: _Kernel(getattr(self.fn, "__name__", "kernel"), log, run_cls)

    saved = (launch.interpreting, tattn.interpreting, launch._DIRECT, os.environ.get("PISA_ATTN_AUTOTUNE"))
    launchers = [x for m in _launcher_modules() for x in vars(m).values() if isinstance(x, launch.Launcher)]
    fns = {id(x): x.fn for x in launchers}
    caches = {id(x): x._cache for x in launchers}
    clear_plans()  # a cached plan's replays hold the launchers they were recorded with
    try:
        launch.interpreting = tattn.interpreting = lambda: False
        launch._DIRECT = True
        os.environ["PISA_ATTN_AUTOTUNE"] = "0"
        for x in launchers:
            x.fn, x._cache = FakeFn(fns[id(x)]), {}
        yield log
    finally:
        launch.interpreting, tattn.interpreting, launch._DIRECT = saved[:3]
        if saved[3] is None:
            os.environ.pop("PISA_ATTN_AUTOTUNE", None)
        else:
            os.environ["PISA_ATTN_AUTOTUNE"] = saved[3]
        for x in launchers:
            x.fn, x._cache = fns[id(x)], caches[id(x)]
        clear_plans()


def _launcher_modules():
    from pisa_attn.ops.triton import attention, pairs, prepare, select

    return (attention, pairs, prepare, select)
