"""Test-only: let diffusers run context parallelism on CPU ranks (gloo tests, ``--tiny``
benchmarks). It patches diffusers and torch process-wide, so it lives with the tests, never in
the library; import it only in CPU test or benchmark processes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from pisa_attn.parallel.comm import all_gather_var, gather_ints


def allow_cpu_context_parallel() -> None:
    """Let diffusers run context parallelism on CPU ranks (gloo tests, ``--tiny`` benchmarks).

    diffusers picks each rank's device as ``rank % torch.accelerator.device_count()``, which divides
    by zero on a CPU-only torch: report one "device" (the CPU) instead. Its uneven split
    (``*_anything``) gathers outputs with an all-gather of unequal sizes, which NCCL runs and gloo
    refuses: on gloo groups, gather padded instead. Process-wide: call it only in CPU test or
    benchmark processes.
    """
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1
    from diffusers.hooks import context_parallel as dcp

    original = dcp._all_gather_anything
    if getattr(original, "_pisa_gloo", False):
        return

    def gather(tensor: Tensor, dim: int, group) -> Tensor:
        if dist.get_backend(group) != "gloo":
            return original(tensor, dim, group)
        sizes = [r[0] for r in gather_ints([tensor.shape[dim]], group, tensor.device)]
        return all_gather_var(tensor.contiguous(), dim, sizes, group)

    gather._pisa_gloo = True
    dcp._all_gather_anything = gather
