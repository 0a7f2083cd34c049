"""Where a sequence-parallel call spends its time, measured on the device's own clock.

The parallel entry points mark their phases (statistics, selection, attend, waiting for the ring,
merge, token redistribution, ...) with :func:`phase`. Outside :func:`record` a mark costs one
context-variable read; inside, it records a CUDA event pair on the current stream (host clock for
CPU tensors), so GPU phases are timed without synchronising. ``"wait"`` is the time the compute
stream stalls on communication that compute did not hide.

    with record() as times:
        model(**inputs)
    times.totals()   # {"attend": ms, "wait": ms, ...}, synchronises once
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import defaultdict

import torch

_active: contextvars.ContextVar["PhaseTimes | None"] = contextvars.ContextVar("pisa_parallel_phases", default=None)


class PhaseTimes:
    """Marks recorded by :func:`phase` while :func:`record` is open."""

    def __init__(self) -> None:
        self._marks: list[tuple[str, object, object]] = []

    def add(self, name: str, start, end) -> None:
        self._marks.append((name, start, end))

    def totals(self) -> dict[str, float]:
        """Milliseconds per phase name, summed over every mark (synchronises the device once)."""
        if any(isinstance(s, torch.cuda.Event) for _, s, _ in self._marks):
            torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for name, s, e in self._marks:
            out[name] += s.elapsed_time(e) if isinstance(s, torch.cuda.Event) else (e - s) * 1e3
        return dict(out)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for name, _, _ in self._marks:
            out[name] += 1
        return dict(out)


@contextlib.contextmanager
def record():
    """Collect the phases of every parallel call inside the block; yields a :class:`PhaseTimes`."""
    times = PhaseTimes()
    token = _active.set(times)
    try:
        yield times
    finally:
        _active.reset(token)


@contextlib.contextmanager
def phase(name: str, device: torch.device):
    """Mark the enclosed work as phase ``name`` (no-op unless :func:`record` is open)."""
    times = _active.get()
    if times is None:
        yield
        return
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        times.add(name, start, end)
    else:
        t0 = time.perf_counter()
        yield
        times.add(name, t0, time.perf_counter())
