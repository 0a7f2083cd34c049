"""PISA under diffusers context parallelism (``transformer.enable_parallelism``).

diffusers shards every token stream of the model over the ranks before the blocks (FLUX: text and
image separately, so rank r holds ``[text_r, image_r]``) and calls the attention backend with this
rank's slice. PISA's result depends on which tokens share a block, so it must see the
single-process sequence: under context parallelism the model keeps its own token order (the tiling
hooks stand aside, see :func:`tokens_stay_in_model_order`) and each attention call maps the
gathered order onto the single-process tiled order with one permutation:

* Ulysses (``ulysses_degree > 1``): all-to-all to the whole sequence for H/N heads, permute, run the
  single-process backend computation (:func:`.calls.sparse_attention` / dense), permute back,
  all-to-all back (:func:`pisa_attn.parallel.ulysses_attention`);
* ring (``ring_degree > 1``): :func:`pisa_attn.parallel.ring_pisa_attention` with global statistics
  and selection for the image queries, the text queries attending exactly in the same pass round
  the ring; dense (warm-up) calls run exact attention through the same ring (density 1);
* both (unified sequence parallelism, the ``(ring, ulysses)`` mesh diffusers builds): Ulysses inside
  each group, ring across the groups (:func:`pisa_attn.parallel.unified_pisa_attention`).

All equal the single-process output (same selection, float tolerance). The token streams must be
split as diffusers splits them: evenly (each length divisible by the number of ranks), or, with
``ring_anything=True`` / ``ulysses_anything=True``, by ``tensor_split`` (any length; the ring then
redistributes whole blocks). A length diffusers' even split would refuse is reported by
:func:`check_token_split` before diffusers shards anything. Attention masks and observers (capture,
telemetry) raise a clear error. Inference only.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from ..layout import block_floor
from ..parallel import ring_pisa_attention, ulysses_attention, unified_pisa_attention
from ..parallel.comm import gather_ints
from ..parallel.phases import phase
from ..parallel.ulysses import local_heads
from . import hooks
from .calls import dense_attention, sparse_attention
from .state import Sequence, current_run


def context_parallel_config(obj, config: bool = False):
    """The active ``ContextParallelConfig`` of a transformer or processor (or, with ``config``, of a
    diffusers ``ParallelConfig``), else None."""
    pc = obj if config else getattr(obj, "_parallel_config", None)
    cp = getattr(pc, "context_parallel_config", None)
    if cp is None or (cp.ring_degree or 1) * (cp.ulysses_degree or 1) <= 1:
        return None
    return cp


def check_no_tensor_parallel(transformer) -> None:
    """ValueError when diffusers' tensor parallelism is enabled on ``transformer``: it shards the
    projections by heads while the attention modules keep the full head count, which PISA's
    processors and per-head weights read (context parallelism is what PISA runs under)."""
    pc = getattr(transformer, "_parallel_config", None)
    if getattr(pc, "tensor_parallel_config", None) is not None:
        raise ValueError(f"{type(transformer).__name__} runs diffusers tensor parallelism, which PISA does not "
                         "support (its attention layers keep the full head count over sharded projections): "
                         "use context parallelism (ContextParallelConfig) instead")


def tokens_stay_in_model_order(transformer) -> bool:
    """True under context parallelism: the boundary hooks must not tile tokens, since diffusers
    shards them before they reach those hooks; attention applies the tiling per call instead."""
    return context_parallel_config(transformer) is not None


def check_token_split(transformer, seq: Sequence) -> None:
    """ValueError naming the fix when diffusers' even split would refuse this call's token streams
    (called at the start of the transformer's forward, before diffusers shards anything; its own
    splitter fails with a bare assertion)."""
    cp = context_parallel_config(transformer)
    if cp is None or cp.ulysses_anything or cp.ring_anything:  # tensor_split: any length
        return
    world = cp.ring_degree * cp.ulysses_degree
    streams = {("image" if (a, b) == (seq.image_lo, seq.image_hi) else "text"): b - a
               for a, b in _runs(seq.image_lo, seq.image_hi, seq.length)}  # fmt: skip
    bad = {name: n for name, n in streams.items() if n % world}
    if not bad:
        return
    what = ", ".join(f"{n} {name} tokens" for name, n in bad.items())
    if cp.ring_degree > 1 and cp.ulysses_degree > 1:
        fix = (
            "diffusers splits unevenly only with one kind of parallelism: use ContextParallelConfig(ring_degree="
            f"{world}, ring_anything=True) or (ulysses_degree={world}, ulysses_anything=True), or a size whose "
            f"token counts divide by {world}"
        )
    else:
        kind = "ring" if cp.ring_degree > 1 else "ulysses"
        fix = f"pass ContextParallelConfig({kind}_degree={world}, {kind}_anything=True) (PISA runs uneven shards)"
    raise ValueError(
        f"context parallelism over {world} ranks: diffusers splits each token stream evenly, but this call has "
        f"{what} (not divisible by {world}); {fix}"
    )


def parallel_attention(state, layer: int, q: Tensor, k: Tensor, v: Tensor, mask, parallel_config) -> Tensor:
    """A call of managed layer ``layer`` under context parallelism; q/k/v ``[B, L_local, H, D]``,
    this rank's slice."""
    scale, enable_gqa = None, q.shape[2] != k.shape[2]
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None:
        raise ValueError("PISA's attention supports diffusers context parallelism only (no other parallel_config)")
    if mask is not None:
        raise ValueError("PISA's attention does not support attention masks under context parallelism")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"PISA's attention supports only self-attention under context parallelism (q has {q.shape[1]} local "
            f"tokens, k {k.shape[1]})"
        )
    groups = _Groups.of(cp)
    run = current_run()
    if run is None or run.state is not state:
        raise ValueError(
            "under context parallelism PISA's attention runs only inside its transformer's forward: it must know "
            "the token layout to build the same blocks as on one GPU"
        )
    seq, lens = _managed_sequence(run, q.shape[1], groups.rank, groups.world)
    if seq is None:
        # Not a layout diffusers' split explains: gather the lengths (one host sync) to know.
        lens = tuple(r[0] for r in gather_ints([q.shape[1]], groups.flat, q.device))
        seq = run.sequence(sum(lens), sum(lens))
        if seq is not None:
            pisa_order(seq, lens)  # raises: a managed sequence, sharded unlike diffusers' split
    if seq is None:  # self-attention that PISA does not manage: exact attention
        return _dense(q, k, v, scale, enable_gqa, groups, list(lens))
    total = seq.length
    if hooks.observers(state.transformer):
        raise ValueError("attention observers (capture, telemetry, calibrate=True) are not supported under context "
                         "parallelism: calibrate offline (pisa-attn calibrate) and pass alpha_table=")
    reason = run.dense_reason(layer, total)
    if reason is not None:
        out = _dense(q, k, v, scale, enable_gqa, groups, list(lens))
    else:
        settings = state.settings_for(layer)
        if settings.query_block is not None:
            raise ValueError("apply_pisa(query_block=...) runs on one process only: under context parallelism PISA "
                             "selects per block; apply it without query_block")
        alpha = state.alpha_for(layer)
        if groups.ring is not None:
            out = _ring_sparse(q, k, v, seq, settings.scale, settings, groups, list(lens), alpha)
        else:
            perm = pisa_order(seq, lens)
            u_rank, u = dist.get_rank(groups.ulysses), dist.get_world_size(groups.ulysses)
            alpha = local_heads(alpha, slice(u_rank * q.shape[2] // u, (u_rank + 1) * q.shape[2] // u))

            def single_process(qf, kf, vf):  # [B, h, L, D] in PISA order
                qs, ks, vs = (x.transpose(1, 2) for x in (qf, kf, vf))
                with phase("attend", qf.device):
                    out = sparse_attention(qs, ks, vs, seq, None, settings, alpha=alpha, plans=state.plans)
                    return out.transpose(1, 2)

            out = ulysses_attention(
                q, k, v, single_process, group=groups.ulysses, layout="bshd", perm=perm, seq_lens=list(lens)
            )
    state.stats["sparse" if reason is None else "dense"] += 1
    if reason is not None:
        state.stats[reason] += 1
    return out


class _Groups:
    """The process groups of one ``ContextParallelConfig``: Ulysses and ring (None when degree 1)
    and the flattened group diffusers shards tokens over (rank ``ring_rank * u + ulysses_rank``)."""

    def __init__(self, cp):
        self.ulysses = cp._ulysses_mesh.get_group() if cp.ulysses_degree > 1 else None
        self.ring = cp._ring_mesh.get_group() if cp.ring_degree > 1 else None
        self.flat = cp._flattened_mesh.get_group()
        self.rank, self.world = dist.get_rank(self.flat), dist.get_world_size(self.flat)

    @classmethod
    def of(cls, cp) -> "_Groups":
        # The config outlives the calls and its groups do not change: one lookup per config.
        ref, got = _GROUPS.get(id(cp), (None, None))
        if ref is None or ref() is not cp:
            got = cls(cp)
            _GROUPS[id(cp)] = (weakref.ref(cp), got)
        return got


_GROUPS: dict[int, tuple] = {}


def _dense(q, k, v, scale, enable_gqa, groups: _Groups, lens: list[int]) -> Tensor:
    if groups.ring is not None:  # density 1: every key block exact, i.e. exact attention merged over the ring
        kw = dict(density=1.0, scale=scale, layout="bshd", seq_lens=lens)
        if groups.ulysses is None:
            return ring_pisa_attention(q, k, v, group=groups.ring, **kw)
        return unified_pisa_attention(q, k, v, ulysses_group=groups.ulysses, ring_group=groups.ring, **kw)

    def single_process(qf, kf, vf):
        qs, ks, vs = (x.transpose(1, 2) for x in (qf, kf, vf))
        with phase("attend", qf.device):
            return dense_attention(qs, ks, vs, None, scale, enable_gqa).transpose(1, 2)

    return ulysses_attention(q, k, v, single_process, group=groups.ulysses, layout="bshd", seq_lens=lens)


def _ring_sparse(q, k, v, seq: Sequence, scale, settings, groups: _Groups, lens: list[int], alpha=None) -> Tensor:
    """As :func:`.calls.sparse_attention`: PISA for the image queries (from the block boundary at or
    before the first, so their query blocks are the key blocks' tiles; text key blocks kept exact),
    exact attention for the text queries, in one pass round the ring."""
    density, mode, cov, bs = settings.density, settings.mode, settings.covariance_aware, settings.block_size
    perm, q_perm, exact = _orders(seq, lens, bs)
    kw = dict(
        density=density, block_size=bs, mode=mode, covariance_aware=cov, scale=scale, layout="bshd",
        keep_blocks=seq.keep_for(seq.length, bs), perm=perm, q_perm=q_perm, exact_queries=exact, seq_lens=lens,
        alpha=alpha,
    )  # fmt: skip
    if groups.ulysses is None:
        return ring_pisa_attention(q, k, v, group=groups.ring, **kw)
    return unified_pisa_attention(q, k, v, ulysses_group=groups.ulysses, ring_group=groups.ring, **kw)


def _managed_sequence(run, local_len: int, rank: int, world: int):
    """(sequence, per-rank lengths) of the managed sequence whose even split gives this rank
    ``local_len`` tokens, without communication; (None, None) when none does, or when some rank
    could not tell the two sequences apart by its length (text shorter than the ranks: that rank
    would pick by itself; every rank then gathers the lengths instead)."""
    seqs = (run.layouts.joint, run.layouts.image_only)
    splits = [_even_split(s.image_lo, s.image_hi, s.length, world) for s in seqs]
    if splits[0] != splits[1] and any(a == b for a, b in zip(*splits)):
        return None, None
    for seq, lens in zip(seqs, splits):
        if lens[rank] == local_len:
            return seq, lens
    return None, None


def _runs(image_lo: int, image_hi: int, total: int) -> list[tuple[int, int]]:
    # Model order: contiguous text/image runs ([text][image], [image][text] or [image]); text stays in
    # place in the tiled order, so the runs have the same bounds in both orders.
    return sorted([(image_lo, image_hi)] + [(a, b) for a, b in ((0, image_lo), (image_hi, total)) if b > a])


def _even_split(image_lo: int, image_hi: int, total: int, world: int) -> tuple[int, ...]:
    """Per-rank tokens when diffusers splits each token stream evenly (``tensor_split``)."""
    runs = _runs(image_lo, image_hi, total)
    return tuple(sum((b - a) // world + (r < (b - a) % world) for a, b in runs) for r in range(world))


def _orders(seq: Sequence, lens, block_size: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(PISA order of the gathered sequence; the PISA queries, the image rows from the block boundary
    at or before the first, or None when that is the whole sequence; the text queries, which attend
    exactly, or None): the same tensor objects on every call, which the ring's plan cache keys on."""
    return _orders_cached(seq.layout, seq.image_lo, seq.image_hi, tuple(lens), block_size)


# Cached past the call that made them (maybe under torch.inference_mode()): plain tensors, whose
# version counters the ring's and Ulysses' caches read.
@functools.lru_cache(maxsize=32)
@torch.inference_mode(False)
def _orders_cached(layout, image_lo: int, image_hi: int, lens: tuple[int, ...], block_size: int):
    perm = _pisa_order(layout, image_lo, image_hi, lens)
    start = block_floor(image_lo, block_size)
    q_perm = None if start == 0 and image_hi == layout.num_tokens else perm[start:image_hi].clone()
    texts = [perm[a:b] for a, b in _runs(image_lo, image_hi, layout.num_tokens) if (a, b) != (image_lo, image_hi)]
    return perm, q_perm, torch.cat(texts) if texts else None


def pisa_order(seq: Sequence, lens: tuple[int, ...]) -> Tensor:
    """Gathered position of each position of the single-process (tiled) sequence."""
    return _pisa_order(seq.layout, seq.image_lo, seq.image_hi, lens)


@functools.lru_cache(maxsize=32)
@torch.inference_mode(False)  # as _orders_cached
def _pisa_order(layout, image_lo: int, image_hi: int, lens: tuple[int, ...]) -> Tensor:
    total, world = layout.num_tokens, len(lens)
    runs = _runs(image_lo, image_hi, total)
    chunks = [torch.arange(a, b).tensor_split(world) for a, b in runs]  # diffusers: even split per stream
    per_rank = [torch.cat([c[r] for c in chunks]) for r in range(world)]
    got = [p.numel() for p in per_rank]
    if got != list(lens):
        text = [b - a for a, b in runs if (a, b) != (image_lo, image_hi)]
        raise ValueError(
            f"context-parallel shards hold {list(lens)} tokens per rank; PISA expects each token "
            f"stream (text {text}, image {image_hi - image_lo}) split evenly over the ranks, i.e. {got}"
        )
    model_of_gathered = torch.cat(per_rank)
    gathered_of_model = torch.empty_like(model_of_gathered)
    gathered_of_model[model_of_gathered] = torch.arange(total)
    return gathered_of_model[layout.perm]
