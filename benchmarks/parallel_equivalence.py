"""Context parallelism on the kernels at real sizes: ring and Ulysses PISA (Hopper backend) on each
rank's shard against one process on the global sequence (rel-L1 and the largest |Δ lse| of the
rank's rows), with the chain's kernels launched plainly and as programmatic dependents
(``pisa_attn.ops.triton.grid.GRID_DEPENDENCY`` "off" and "wait": their outputs must be the same
bits). Random B1-H8-D128 bf16, 12.5 %, covariance-aware hybrid and keep-or-drop, a block-aligned
length, one whose key shards straddle the exact loop's 16K-key switch, and a ragged one; on 4 or more
ranks (an even number) also Ulysses 2 x ring N/2 through ``unified_pisa_attention``. No diffusers
needed; writes ``$OUT/parallel_equivalence.json``.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/parallel_equivalence.py
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
import triton

from pisa_attn import pisa_attention
from pisa_attn.ops.triton import grid
from pisa_attn.parallel import ring_pisa_attention, ulysses_pisa_attention, unified_pisa_attention

LENGTHS = (16384, 32760, 32768 + 4096 - 37)  # 32760: key shards of 16384 and 16376, across the kernel's 16K switch


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    kinds = [("ring", ring_pisa_attention), ("ulysses", ulysses_pisa_attention)]
    if world >= 4 and world % 2 == 0:
        # Ulysses 2 x ring world/2 on a row-major (ring, ulysses) grid: rank ring_rank * 2 + ulysses_rank
        # holds slice `rank` of the global sequence, the layout unified_pisa_attention documents.
        u, r = 2, world // 2
        groups = {}
        for j in range(r):
            groups[("u", j)] = dist.new_group([j * u + i for i in range(u)])
        for i in range(u):
            groups[("r", i)] = dist.new_group([j * u + i for j in range(r)])
        ug, rg = groups[("u", rank // u)], groups[("r", rank % u)]
        kinds.append(("unified", lambda *a, **kw: unified_pisa_attention(*a, ulysses_group=ug, ring_group=rg, **kw)))
    rows = []
    saved = grid.GRID_DEPENDENCY
    try:
        for L in LENGTHS:
            g = torch.Generator(device="cuda").manual_seed(L)
            q, k, v = (torch.randn(1, 8, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            sl = slice(L * rank // world, L * (rank + 1) // world)
            shard = [x[:, :, sl].contiguous() for x in (q, k, v)]
            for mode, cov in (("hybrid", True), ("drop", False)):
                kw = dict(density=0.125, mode=mode, covariance_aware=cov, backend="hopper", return_lse=True)
                outs = {}
                for level in ("off", "wait"):
                    grid.GRID_DEPENDENCY = level
                    want, want_lse = pisa_attention(q, k, v, **kw)
                    ref = want[:, :, sl].double()
                    for name, fn in kinds:
                        t0 = time.perf_counter()
                        out, lse = fn(*shard, **kw)
                        if rank == 0:  # progress: a slow first compile and a hang look alike otherwise
                            print(f"L={L} {mode} {level} {name}: {time.perf_counter() - t0:.1f} s", flush=True)
                        outs[(name, level)] = out
                        rows.append(dict(rank=rank, L=L, mode=mode, covariance_aware=cov, kind=name, level=level,
                                         rel_l1=float((out.double() - ref).abs().sum() / ref.abs().sum()),
                                         lse_max_abs=float((lse - want_lse[:, :, sl]).abs().max()),
                                         finite=bool(torch.isfinite(out).all())))
                for name, _ in kinds:
                    rows.append(dict(rank=rank, L=L, mode=mode, kind=name,
                                     levels_bitwise=bool(torch.equal(outs[(name, "off")], outs[(name, "wait")]))))
    finally:
        grid.GRID_DEPENDENCY = saved
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        flat = [r for part in gathered for r in part]
        env = dict(device=torch.cuda.get_device_name(), gpus=world, torch=torch.__version__, triton=triton.__version__)
        with open(os.path.join(os.environ.get("OUT", "."), "parallel_equivalence.json"), "w") as f:
            json.dump(dict(env, rows=flat), f, indent=1)
        for r in flat:
            print(r)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
