"""Checks shared by the sequence-parallel entry points: local arguments, then the facts every rank
must agree on (gathered once, so a mismatch raises the same error on every rank instead of hanging)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import to_bhsd, validate
from .comm import gather_ints, group_info


@dataclass(frozen=True)
class Shards:
    rank: int
    world: int
    q_lens: list[int]  # per-rank local query lengths, rank order
    k_lens: list[int]
    batch: int
    heads: int
    kv_heads: int
    head_dim: int


def check_inputs(q, k, v, *, group, density, block_size, mode, scale, layout, backend, what: str,
                 covariance_aware=False, return_lse=False, seq_lens=None, alpha=None):  # fmt: skip
    """Validate one rank's local q/k/v; return ``[B, H, L, D]`` views and the gathered shard facts.

    ``seq_lens``: per-rank local lengths (q and k/v alike) when the caller knows them; skips the
    all-gather (and its host sync), and with it the check that all ranks agree on B/H/Hk/D.
    """
    qh, kh, vh = validate(q, k, v, density=density, block_size=block_size, mode=mode, scale=scale, layout=layout,
                          backend=backend, covariance_aware=covariance_aware, return_lse=return_lse, alpha=alpha)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        # The collectives here are not autograd-aware; a silently missing gradient is worse than an error.
        raise ValueError(f"{what} is inference-only: call it under torch.no_grad() (q/k/v require grad)")
    rank, world = group_info(group)
    b, h, lq, d = qh.shape
    hk, lk = kh.shape[1], kh.shape[2]
    if seq_lens is not None:
        lens = list(seq_lens) if isinstance(seq_lens, (list, tuple)) else None
        if lens is None or len(lens) != world or not all(isinstance(n, int) and n > 0 for n in lens):
            raise ValueError(f"seq_lens must list {world} positive ints (one local length per rank), got {seq_lens!r}")
        if lens[rank] != lq or lens[rank] != lk:
            raise ValueError(f"seq_lens[{rank}] = {lens[rank]} but this rank holds {lq} queries and {lk} keys")
        return qh, kh, vh, Shards(rank, world, lens, lens, b, h, hk, d)
    facts = gather_ints([lq, lk, b, h, hk, d], group, q.device)
    head = facts[0][2:]
    for r, f in enumerate(facts):
        if f[2:] != head:
            raise ValueError(
                f"{what}: every rank must hold the same batch/heads/kv_heads/head_dim, rank 0 has {head}, "
                f"rank {r} has {f[2:]} ([B, H, Hk, D] of its local q/k)"
            )
    shards = Shards(rank, world, [f[0] for f in facts], [f[1] for f in facts], b, h, hk, d)
    return qh, kh, vh, shards


to_layout = to_bhsd  # [B, H, L, D] <-> layout is its own inverse
