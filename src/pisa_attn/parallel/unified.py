"""PISA under unified sequence parallelism: Ulysses inside groups, ring across them.

Ranks form a grid of ``ring`` x ``ulysses`` (diffusers' ``ContextParallelConfig(ring_degree=r,
ulysses_degree=u)`` builds exactly this mesh). An all-to-all inside each Ulysses group turns "my
slice, all heads" into "my group's slices, H/u heads"; the groups' sequences are then the ring's
shards, and :func:`pisa_attn.parallel.ring_pisa_attention` runs across the ring group (global
statistics and selection, one merge); a second all-to-all returns the heads.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ..settings import UNPASSED as _U
from ..settings import PisaSettings
from .common import checked_lens, entry_settings, local_check, settings_fingerprint
from .comm import gather_ints, group_info
from .ring import ring_pisa_attention
from .ulysses import local_heads, local_keep, ulysses_attention


def unified_pisa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    ulysses_group,
    ring_group,
    density: float = _U["density"],
    block_size: int = _U["block_size"],
    mode: str = _U["mode"],
    covariance_aware: bool | None = None,
    scale: float | None = None,
    layout: str = _U["layout"],
    keep_blocks: Tensor | None = None,
    perm: Tensor | None = None,
    q_perm: Tensor | None = None,
    exact_queries: Tensor | None = None,
    return_lse: bool = False,
    backend: str = _U["backend"],
    seq_lens: list[int] | None = None,
    alpha=None,
    query_block: int | None = None,
    settings: PisaSettings | None = None,
):
    """Ulysses x ring PISA: this rank's slice of ``pisa_attention`` over the global sequence.

    Args:
        q, k, v: this rank's contiguous slice, ``layout`` as in :func:`pisa_attn.pisa_attention`.
            The global sequence is the concatenation over ring ranks of each Ulysses group's
            slices in Ulysses-rank order (rank ``ring_rank * u + ulysses_rank`` of a row-major
            ``(ring, ulysses)`` grid holds the slice of that index).
        ulysses_group, ring_group: this rank's Ulysses group (size ``u``, splits heads: the query
            heads must be divisible by ``u``) and ring group (size ``r``; ranks at the same
            Ulysses position of every group).
        seq_lens: per-rank local lengths in global-sequence order (``r * u`` entries), when every
            rank knows them; as in the ring, nothing is then exchanged up front: the ranks must pass
            the same settings, dtype and ``[B, H, Hk, D]``, and an error on one rank leaves the
            others waiting. Default: gathered and checked on every rank.
        Everything else as in :func:`pisa_attn.parallel.ring_pisa_attention` (``perm``, ``q_perm``,
        ``exact_queries`` and ``keep_blocks`` index the global sequence; a per-head ``keep_blocks``
        or ``alpha`` follows its heads).

    Returns:
        ``out`` for this rank's queries (shape/layout of ``q``), plus ``lse`` [B, H, Lq] when
        ``return_lse``. Inference only.
    """
    # The settings and tensors are checked here, once for the grid: an error is raised on every rank
    # after one exchange (the ring checks the tensors again per group).
    what = "unified_pisa_attention"
    s, alpha, error = entry_settings(settings, alpha, what=what, deferrable=seq_lens is None and isinstance(q, Tensor),
                                     sharded_keys=True, density=density, block_size=block_size, mode=mode,
                                     covariance_aware=covariance_aware, scale=scale, layout=layout, backend=backend,
                                     query_block=query_block)
    u_rank, u = group_info(ulysses_group)
    r_rank, r = group_info(ring_group)
    _check_crossing(ulysses_group, ring_group, u, r)
    u_lens = ring_lens = None
    if seq_lens is not None:
        lens = checked_lens(seq_lens, u * r, "local lengths of the ring x ulysses ranks")
        u_lens = lens[r_rank * u : (r_rank + 1) * u]
        ring_lens = [sum(lens[j * u : (j + 1) * u]) for j in range(r)]
    # as ring and Ulysses: with seq_lens given the ranks are trusted to agree and errors raise here
    views, local_error = local_check(q, k, v, s, what=what, return_lse=return_lse, alpha=alpha,
                                     defer=seq_lens is None, pre_error=error)
    if seq_lens is None:
        shape = [0] * 4 if local_error is not None else [*views[0].shape[:2], views[1].shape[1], views[0].shape[3]]
        _agree_on_grid(local_error, settings_fingerprint(s, q.dtype), shape, ulysses_group, ring_group, q.device,
                       u_rank)
    layout = s.layout
    heads = q.shape[1 if layout == "bhsd" else 2]
    keep = local_keep(keep_blocks, heads, slice(u_rank * heads // u, (u_rank + 1) * heads // u))
    alpha = local_heads(alpha, slice(u_rank * heads // u, (u_rank + 1) * heads // u))

    inner = s.replace(layout="bhsd")  # the Ulysses group's [B, H/u, L, D] sequence

    def ring(qf, kf, vf):  # [B, H/u, L_group, D]: this Ulysses group's sequence, my heads
        return ring_pisa_attention(
            qf, kf, vf, group=ring_group, settings=inner, keep_blocks=keep, perm=perm, q_perm=q_perm,
            exact_queries=exact_queries, return_lse=True, seq_lens=ring_lens, alpha=alpha,
        )  # fmt: skip

    out, lse = ulysses_attention(q, k, v, ring, group=ulysses_group, layout=layout, seq_lens=u_lens)
    return (out, lse) if return_lse else out


def _check_crossing(ulysses_group, ring_group, u: int, r: int) -> None:
    """The two groups must cross in this rank alone (its Ulysses peers are not its ring peers);
    read from the groups on the host, no exchange. That every ring peer sits at this rank's
    Ulysses position is checked by :func:`_agree_on_grid` (trusted with ``seq_lens``)."""
    world = dist.group.WORLD
    mine = set(dist.get_process_group_ranks(ulysses_group or world))
    ring = set(dist.get_process_group_ranks(ring_group or world))
    if mine & ring != {dist.get_rank()}:
        raise ValueError(f"ulysses_group ({u} ranks) and ring_group ({r} ranks) must be two groups forming a "
                         f"ring x ulysses grid: they may share only this rank, but share ranks {sorted(mine & ring)}")


def _agree_on_grid(local_error, fingerprint: int, shape: list[int], ulysses_group, ring_group, device,
                   u_rank: int) -> None:
    """Raise on every rank of the grid when any rank refused its inputs, called with other settings
    or dtype, holds another ``[B, H, Hk, D]``, or its ring peers sit at other positions of their
    Ulysses groups (no grid: their heads differ): the Ulysses group's verdict, then the ring
    group's over those (every rank shares a Ulysses group with one rank of each ring group), two
    small gathers."""
    facts = gather_ints([int(local_error is not None), fingerprint, *shape], ulysses_group, device)
    shapes = {tuple(f[2:]) for f in facts if not f[0]}
    group_verdict = [int(any(f[0] for f in facts)), int(len({f[1] for f in facts}) > 1 or len(shapes) > 1),
                     facts[0][1], *(next(iter(shapes)) if shapes else [0] * 4), u_rank]
    verdicts = gather_ints(group_verdict, ring_group, device)
    if local_error is not None:
        raise local_error
    if any(v[0] for v in verdicts):
        raise ValueError("unified_pisa_attention: another rank refused its inputs (its error says why)")
    if len({v[7] for v in verdicts}) > 1:
        raise ValueError("ulysses_group and ring_group must form a ring x ulysses grid: every rank of a ring group "
                         f"must hold the same position in its Ulysses group (positions {[v[7] for v in verdicts]})")
    if any(v[1] for v in verdicts) or len({v[2] for v in verdicts}) > 1 or len({tuple(v[3:7]) for v in verdicts}) > 1:
        raise ValueError("unified_pisa_attention: every rank must call with the same settings and dtype and hold the "
                         f"same batch/heads/kv_heads/head_dim (this rank: [B, H, Hk, D] = {shape})")
