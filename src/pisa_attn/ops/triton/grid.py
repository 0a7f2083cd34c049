"""Programmatic dependent launch for the kernels of one call's chain (statistics, selection, the
query-block stream, the Hopper attention kernel): each is launched so that the GPU may start it while the kernel before it in the
stream drains, and its first act is to wait for that kernel (``griddepcontrol.wait``: its writes
are then visible), so the order of effects is the stream's. What it saves is the gap between
kernels: the next one's launch, and with ``"trigger"`` its programs' start under the last wave of
the one before (every program of a kernel lets the next one launch once it has passed its wait)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import interpreting

try:  # NVIDIA's grid control, where this Triton has it; elsewhere the chain launches plainly
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

# "off": every kernel of the chain launches after the one before it has finished, as any launch
# does; "wait": launched as dependents, each waits first; "trigger": and lets the next one launch.
# Whole call on an H100 (benchmarks/grid_dependency.py, 5 rounds, bit for bit the same output):
# "wait" 2.4-2.7 % faster than "off" at 4K, 1.4-1.6 % at 8K, within the rounds' spread at 32K;
# "trigger" 1.7-2.1 % at 4K but 0.3-1.2 % slower than "off" at 8K (its early programs take SMs
# the kernel before still needs), and its trigger made one top-k build spill under CUDA 13's ptxas.
GRID_DEPENDENCY = "wait"
LEVELS = {"off": 0, "wait": 1, "trigger": 2}


@functools.lru_cache(maxsize=8)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def level() -> int:
    """The ``PDL`` level of :data:`GRID_DEPENDENCY` (what a build for sm_90 takes)."""
    if GRID_DEPENDENCY not in LEVELS:
        raise ValueError(f"GRID_DEPENDENCY must be one of {sorted(LEVELS)}, got {GRID_DEPENDENCY!r}")
    return LEVELS[GRID_DEPENDENCY]


def grid_dependency(device: torch.device) -> int:
    """The ``PDL`` level the chain's kernels on ``device`` are built and launched with (0: plain
    launches; sm_90 on, never under the interpreter)."""
    if interpreting() or device.type != "cuda" or gdc_wait is None:
        return 0
    if _major(device.index if device.index is not None else torch.cuda.current_device()) < 9:
        return 0
    return level()


@triton.jit
def await_prior_grid(PDL: tl.constexpr):
    """A kernel's first statement: with ``PDL`` ≥ 1 (a dependent launch), wait until the kernel
    before it in the stream has finished and its writes are visible; with 2, then let the next one
    launch (its programs start once every program here has passed this point, and wait in turn)."""
    if PDL >= 1:
        gdc_wait()
    if PDL >= 2:
        gdc_launch_dependents()
