"""Checks shared by the sequence-parallel entry points: local arguments, then the facts every rank
must agree on (gathered once, so a mismatch raises the same error on every rank instead of hanging)."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention import to_bhsd, validate
from ..settings import PisaSettings, check_not_both, from_loose
from .comm import gather_ints, group_info


def entry_settings(settings, alpha, *, what: str, deferrable: bool, sharded_keys: bool, **loose):
    """``(settings, alpha, error)`` for a sequence-parallel entry point: :func:`settings_of`; with
    ``sharded_keys`` low precision is refused (sharded keys merge float32 partial outputs, which the
    low-precision kernel does not write). With ``deferrable`` (and a process group up) a refused
    setting comes back as ``error`` beside default settings, for :func:`check_inputs` to raise
    after the gather that tells every rank (raising here would leave the others waiting in it)."""
    try:
        s, alpha = settings_of(settings, alpha, **loose)
        if sharded_keys and s.precision != "input":
            raise ValueError(f"precision={s.precision!r} is not supported by {what} (the low-precision kernel "
                             "writes no float32 partial outputs to merge across ranks): use precision='input'")
        return s, alpha, None
    except (TypeError, ValueError) as e:
        if not (deferrable and dist.is_available() and dist.is_initialized()):  # no other rank to tell
            raise
        return PisaSettings(), None, e


def settings_of(settings, alpha=None, **loose):
    """``(settings, alpha)``: one :class:`PisaSettings` from ``settings=`` or from the loose keyword
    arguments (not both), with its ``alpha`` moved out as per-call data (a per-head tuple becomes a
    CPU tensor, which follows its heads to their rank); an explicit ``alpha`` wins."""
    if settings is None:
        settings = from_loose(**loose)
    elif not isinstance(settings, PisaSettings):
        raise TypeError(f"settings must be a PisaSettings, got {type(settings).__name__}")
    else:
        check_not_both(**loose)
    if settings.alpha is not None:
        if alpha is None:
            alpha = (torch.tensor(settings.alpha, dtype=torch.float64) if isinstance(settings.alpha, tuple)
                     else settings.alpha)  # float64: each call casts it to its own precision
        settings = settings.replace(alpha=None)
    return settings, alpha


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


@functools.lru_cache(maxsize=64)
def settings_fingerprint(settings: PisaSettings, dtype) -> int:
    """One int for the settings (layout aside) and dtype every rank must share: made once per pair."""
    return zlib.crc32(repr((settings.replace(layout="bhsd"), str(dtype))).encode())


def local_check(q, k, v, s: PisaSettings, *, what: str, return_lse, alpha, defer: bool, pre_error=None):
    """``((qh, kh, vh), None)``: this rank's q/k/v validated (``[B, H, L, D]`` views) and not
    requiring grad; or, with ``defer`` and tensors, ``(None, error)`` for the caller to raise after
    a gather that tells every rank (without it the error is raised here). ``pre_error``: the
    settings' error, from :func:`entry_settings`."""
    try:
        if pre_error is not None:
            raise pre_error
        views = validate(q, k, v, density=s.density, block_size=s.block_size, mode=s.mode, scale=s.scale,
                         layout=s.layout, backend=s.backend, covariance_aware=s.covariance_aware,
                         return_lse=return_lse, query_block=s.query_block, alpha=alpha)
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            # The collectives here are not autograd-aware; a silently missing gradient is worse than an error.
            raise ValueError(f"{what} is inference-only: call it under torch.no_grad() (q/k/v require grad)")
        if torch.is_grad_enabled() and isinstance(alpha, torch.Tensor) and alpha.requires_grad:
            raise ValueError(f"{what} is inference-only: call it under torch.no_grad() (alpha requires grad; "
                             "its gradient would not cross the collectives)")
        return views, None
    except (TypeError, ValueError) as e:
        if not defer or not isinstance(q, torch.Tensor):
            raise
        return None, e


def checked_lens(seq_lens, n: int, what: str) -> list[int]:
    """``seq_lens`` as a list of ``n`` positive ints (the same list on every rank, so every rank
    refuses a bad one alike); ValueError naming it otherwise."""
    lens = list(seq_lens) if isinstance(seq_lens, (list, tuple)) else None
    if lens is None or len(lens) != n or not all(isinstance(n_, int) and not isinstance(n_, bool) and n_ > 0
                                                 for n_ in lens):
        raise ValueError(f"seq_lens must list {n} positive ints ({what}), got {seq_lens!r}")
    return lens


def check_inputs(q, k, v, *, group, settings: PisaSettings, what: str, return_lse=False, seq_lens=None,
                 alpha=None, pre_error=None):  # fmt: skip
    """Validate one rank's local q/k/v; return ``[B, H, L, D]`` views and the gathered shard facts.

    ``seq_lens``: per-rank local lengths (q and k/v alike) when the caller knows them; skips the
    all-gather (and its host sync), and with it every agreement check: the ranks must then pass
    the same settings, dtype and B/H/Hk/D, and an error on one rank leaves the others waiting in
    their next collective. ``pre_error``: this rank's settings error (:func:`entry_settings`).
    """
    s = settings
    # an error is raised after the gather below, which every rank then leaves with an error
    views, local_error = local_check(q, k, v, s, what=what, return_lse=return_lse, alpha=alpha,
                                     defer=seq_lens is None, pre_error=pre_error)
    rank, world = group_info(group)
    if local_error is None:
        qh, kh, vh = views
        b, h, lq, d = qh.shape
        hk, lk = kh.shape[1], kh.shape[2]
    if seq_lens is not None:
        lens = checked_lens(seq_lens, world, "one local length per rank")
        if lens[rank] != lq or lens[rank] != lk:
            raise ValueError(f"seq_lens[{rank}] = {lens[rank]} but this rank holds {lq} queries and {lk} keys")
        return qh, kh, vh, Shards(rank, world, lens, lens, b, h, hk, d)
    # the settings and dtype every rank must share, as one int (a mismatch ran a different
    # algorithm per rank, aborted a collective or hung)
    agreed = settings_fingerprint(s, q.dtype)
    mine = [1, 0, 0, 0, 0, 0, 0, agreed] if local_error is not None else [0, lq, lk, b, h, hk, d, agreed]
    facts = gather_ints(mine, group, q.device)
    if local_error is not None:
        raise local_error
    bad = [r for r, f in enumerate(facts) if f[0]]
    if bad:
        raise ValueError(f"{what}: rank {bad[0]} refused its inputs (its error says why)")
    for r, f in enumerate(facts):
        if f[7] != agreed:
            raise ValueError(f"{what}: every rank must call with the same settings and dtype; rank {r} differs from "
                             f"rank {rank} ({s}, {q.dtype})")
    head = facts[0][3:7]
    for r, f in enumerate(facts):
        if f[3:7] != head:
            raise ValueError(
                f"{what}: every rank must hold the same batch/heads/kv_heads/head_dim, rank 0 has {head}, "
                f"rank {r} has {f[3:7]} ([B, H, Hk, D] of its local q/k)"
            )
    shards = Shards(rank, world, [f[1] for f in facts], [f[2] for f in facts], b, h, hk, d)
    return qh, kh, vh, shards


to_layout = to_bhsd  # [B, H, L, D] <-> layout is its own inverse
