"""Running a stage within its time: the stage alarm (a signal timer that cuts a step in flight),
the per-stage clock that skips a step its estimate says will not fit, and the timed calls."""

from __future__ import annotations

import contextlib
import gc
import signal
import statistics
import time
import traceback

import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class StageTimeout(BaseException):
    """Raised by the stage alarm (a BaseException: library code catching Exception lets it pass)."""


@contextlib.contextmanager
def alarm(seconds: float):
    """Raise :class:`StageTimeout` in the main thread after ``seconds``, and again every 2 s (one
    raised inside a finaliser is swallowed), until the block exits."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise StageTimeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01), 2.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Stage:
    """One stage's clock, timer and bookkeeping (steps that ran, steps skipped for time)."""

    def __init__(self, name: str, budget_s: float, run_deadline: float, device, save, shared: dict,
                 est_scale: float = 1.0) -> None:  # fmt: skip
        self.name = name
        self.est_scale = est_scale  # estimates are for the real models on a GPU; ~0 for the tiny ones
        self.start = time.monotonic()
        self.deadline = min(self.start + budget_s, run_deadline)
        self.device = device
        self.save = save
        self.current = "start"
        self.calibration = 1.0  # measured / estimated forward time, once a forward ran
        self.shared = shared  # what later stages of the run plan from (the compile-time scale)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return seconds * self.est_scale <= self.left()

    def step(self, rec: dict, label: str, est_s: float, fn):
        """``fn()``, or None when ``est_s`` does not fit the time left (recorded as skipped) or
        ``fn`` raised (recorded under ``errors``, traceback on stderr: the next steps still run)."""
        if not self.fits(est_s):
            need = est_s * self.est_scale
            rec.setdefault("skipped", []).append(f"{label} (needs ~{need:.0f} s, {self.left():.0f} s left)")
            log(f"{self.name}: skip {label}: needs ~{need:.0f} s, {self.left():.0f} s left")
            self.save()
            return None
        self.current = f"{rec.get('case', '')} {label}".strip()
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as e:
            msg = str(e).splitlines()[0][:300] if str(e) else ""
            rec.setdefault("errors", {})[label] = f"{type(e).__name__}: {msg}"
            log(f"{self.name}: {self.current} failed: {type(e).__name__}: {msg}")
            traceback.print_exc()
            out = None
            torch._dynamo.reset()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        rec.setdefault("step_s", {})[label] = round(time.monotonic() - t0, 2)
        self.save()
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn) -> tuple[float, object]:
        """(ms, output) of one call (CUDA events on the GPU)."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), out
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out

    def measure(self, fn, *, warmup: int, min_iters: int = 1, max_iters: int = 5, target_s: float = 2.0):
        """({ms: median of the timed calls, times_ms, warmup_ms, cold_only}, last output).

        After ``warmup`` untimed calls, timed calls continue while their total is under
        ``target_s`` (at least ``min_iters``, at most ``max_iters``) and another one fits the
        stage's time; when none fits, the warm-up calls are the measurement (``cold_only``)."""
        cold, times, out = [], [], None
        for _ in range(warmup):
            t, out = self.timed(fn)
            cold.append(t)
        while len(times) < max_iters:
            last_s = (times or cold or [0.0])[-1] / 1e3
            if len(times) >= min_iters and sum(times) / 1e3 >= target_s:
                break
            if (times or cold) and not self.fits(last_s):
                break
            t, out = self.timed(fn)
            times.append(t)
        cold_only = not times
        use = times or cold
        return {"ms": statistics.median(use), "times_ms": use, "warmup_ms": cold, "cold_only": cold_only}, out


def free(device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
