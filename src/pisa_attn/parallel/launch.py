"""Run a function on N local processes joined in one process group (CPU/gloo tests, tiny benches).

``run_local(fn, 2, *args)`` calls ``fn(rank, world_size, *args)`` in each process and returns the
per-rank results in rank order. ``fn`` must be importable (a module-level function) and its result
picklable. A failing rank raises in the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, backend, port, fn, args, queue):
    try:
        # Ranks share the machine's few cores; set here, in the rank's own process (and for any
        # process it starts), never in the caller's.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))


START_METHODS = ("spawn", "forkserver")


def run_local(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 300.0,
              start_method: str = "spawn") -> list:
    """Start ``world_size`` processes running ``fn(rank, world_size, *args)``; return their results.

    ``start_method``: ``"spawn"`` (a fresh interpreter per rank) or ``"forkserver"`` (ranks fork
    from one server process that outlives the call, so modules it preloads, see
    ``multiprocessing.set_forkserver_preload``, are imported once for every later call; the ranks
    see the environment the server was started with)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, backend, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, value = queue.get(timeout=0.5)
            except Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout} s")
                continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            if errors:  # the other ranks may be stuck in a collective
                p.kill()
            p.join(5 if errors else timeout)
    if errors:
        raise RuntimeError("a rank failed: " + "\n".join(errors))
    return [results[r] for r in range(world_size)]
