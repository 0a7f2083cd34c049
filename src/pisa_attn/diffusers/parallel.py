"""The ``"pisa"`` backend under diffusers context parallelism (``transformer.enable_parallelism``).

diffusers shards every token stream of the model evenly over the ranks before the blocks (FLUX:
text and image separately, so rank r holds ``[text_r, image_r]``) and calls the attention backend
with this rank's slice. PISA's result depends on which tokens share a block, so it must see the
single-process sequence: under context parallelism the model keeps its own token order (the tiling
hooks stand aside, see :func:`tokens_stay_in_model_order`) and each attention call maps the
gathered order onto the single-process tiled order with one permutation:

* Ulysses (``ulysses_degree > 1``): all-to-all to the whole sequence for H/N heads, permute, run the
  single-process backend computation (:func:`.backend.sparse_attention` / dense), permute back,
  all-to-all back (:func:`pisa_attn.parallel.ulysses_attention`);
* ring (``ring_degree > 1``): :func:`pisa_attn.parallel.ring_pisa_attention` with global statistics
  and selection for the image queries; text queries and dense (warm-up) calls run exact attention
  through the same ring (density 1: every block exact).

Both equal the single-process output (same selection, float tolerance), for token streams split
evenly over the ranks as diffusers' own ``_cp_plan`` s do (FLUX, Wan); other shardings of a managed
sequence raise. Ring and Ulysses together, attention masks, observers (capture, telemetry) and
calls without :func:`apply_pisa` raise a clear error too. Inference only.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ..parallel import ring_pisa_attention, ulysses_attention
from ..parallel.comm import gather_ints
from . import hooks
from .calls import dense_attention, sparse_attention
from .state import Sequence, current_run


def context_parallel_config(module):
    """The active ``ContextParallelConfig`` of a transformer (or processor), else None."""
    pc = getattr(module, "_parallel_config", None)
    cp = getattr(pc, "context_parallel_config", None)
    if cp is None or (cp.ring_degree or 1) * (cp.ulysses_degree or 1) <= 1:
        return None
    return cp


def tokens_stay_in_model_order(transformer) -> bool:
    """True under context parallelism: the boundary hooks must not tile tokens, since diffusers
    shards them before they reach those hooks; attention applies the tiling per call instead."""
    return context_parallel_config(transformer) is not None


def parallel_attention(q: Tensor, k: Tensor, v: Tensor, mask, scale, enable_gqa: bool, parallel_config) -> Tensor:
    """One dispatcher call under context parallelism; q/k/v ``[B, L_local, H, D]``, this rank's slice."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None:
        raise ValueError("the pisa backend supports diffusers context parallelism only (no other parallel_config)")
    if cp.ring_degree > 1 and cp.ulysses_degree > 1:
        raise ValueError(
            "the pisa backend supports ring_degree > 1 or ulysses_degree > 1 under context parallelism, not both "
            f"(got ring_degree={cp.ring_degree}, ulysses_degree={cp.ulysses_degree})"
        )
    if mask is not None:
        raise ValueError("the pisa backend does not support attention masks under context parallelism")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"the pisa backend supports only self-attention under context parallelism (q has {q.shape[1]} local "
            f"tokens, k {k.shape[1]})"
        )
    ring = cp.ring_degree > 1
    group = (cp._ring_mesh if ring else cp._ulysses_mesh).get_group()
    run = current_run()
    if run is None:
        raise ValueError(
            "under context parallelism the pisa backend needs apply_pisa(...) on the transformer: it must know "
            "the token layout to build the same blocks as on one GPU"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    seq, lens = _managed_sequence(run, q.shape[1], rank, world)
    if seq is None:
        # Not a layout diffusers' even split explains: gather the lengths (one host sync) to know.
        lens = tuple(r[0] for r in gather_ints([q.shape[1]], group, q.device))
        seq = run.sequence(sum(lens), sum(lens))
        if seq is not None:
            pisa_order(seq, lens)  # raises: a managed sequence, sharded unlike diffusers' even split
    if seq is None:  # self-attention that PISA does not manage: exact attention
        return _dense(q, k, v, scale, enable_gqa, ring, group, list(lens))
    total = seq.length
    state, cfg = run.state, run.state.config
    if hooks.observers(state.transformer):
        raise ValueError("attention observers (capture, telemetry) are not supported under context parallelism")
    layer = run.next_layer()
    reason = run.dense_reason(layer, total)
    if reason is not None:
        out = _dense(q, k, v, scale, enable_gqa, ring, group, list(lens))
    else:
        perm = pisa_order(seq, lens)
        settings = (cfg.density, cfg.mode, cfg.covariance_aware, cfg.block_size)
        if ring:
            out = _ring_sparse(q, k, v, seq, perm, scale, settings, group, list(lens))
        else:

            def single_process(qf, kf, vf):  # [B, h, L, D] in PISA order
                qs, ks, vs = (x.transpose(1, 2) for x in (qf, kf, vf))
                return sparse_attention(qs, ks, vs, seq, None, scale, settings).transpose(1, 2)

            out = ulysses_attention(
                q, k, v, single_process, group=group, layout="bshd", perm=perm, seq_lens=list(lens)
            )
    state.stats["sparse" if reason is None else "dense"] += 1
    if reason is not None:
        state.stats[reason] += 1
    return out


def _dense(q, k, v, scale, enable_gqa, ring: bool, group, lens: list[int]) -> Tensor:
    if ring:  # density 1: every key block exact, i.e. exact softmax attention merged over the ring
        return ring_pisa_attention(q, k, v, group=group, density=1.0, scale=scale, layout="bshd", seq_lens=lens)

    def single_process(qf, kf, vf):
        qs, ks, vs = (x.transpose(1, 2) for x in (qf, kf, vf))
        return dense_attention(qs, ks, vs, None, scale, enable_gqa).transpose(1, 2)

    return ulysses_attention(q, k, v, single_process, group=group, layout="bshd", seq_lens=lens)


def _ring_sparse(q, k, v, seq: Sequence, perm: Tensor, scale, settings, group, lens: list[int]) -> Tensor:
    """As :func:`.backend.sparse_attention`: PISA for the image queries (their own query blocks, text
    key blocks kept exact), exact attention for the text queries; disjoint rows, so they add."""
    density, mode, cov, bs = settings
    out = ring_pisa_attention(
        q, k, v, group=group, density=density, block_size=bs, mode=mode, covariance_aware=cov, scale=scale,
        layout="bshd", keep_blocks=seq.keep_for(seq.length, bs), perm=perm, q_perm=perm[seq.image_lo : seq.image_hi],
        seq_lens=lens,
    )  # fmt: skip
    texts = seq.text_ranges()
    if texts:
        text_q = torch.cat([perm[a:b] for a, b in texts])
        out = out + ring_pisa_attention(
            q, k, v, group=group, density=1.0, scale=scale, layout="bshd", q_perm=text_q, seq_lens=lens
        )
    return out


def _managed_sequence(run, local_len: int, rank: int, world: int):
    """(sequence, per-rank lengths) of the managed sequence whose even split gives this rank
    ``local_len`` tokens, without communication; (None, None) when none does."""
    for seq in (run.layouts.joint, run.layouts.image_only):
        lens = _even_split(seq.image_lo, seq.image_hi, seq.length, world)
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


def pisa_order(seq: Sequence, lens: tuple[int, ...]) -> Tensor:
    """Gathered position of each position of the single-process (tiled) sequence."""
    return _pisa_order(seq.layout, seq.image_lo, seq.image_hi, lens)


@functools.lru_cache(maxsize=32)
def _pisa_order(layout, image_lo: int, image_hi: int, lens: tuple[int, ...]) -> Tensor:
    total, world = layout.num_tokens, len(lens)
    runs = _runs(image_lo, image_hi, total)
    chunks = [torch.arange(a, b).tensor_split(world) for a, b in runs]  # diffusers: even split per stream
    per_rank = [torch.cat([c[r] for c in chunks]) for r in range(world)]
    got = [p.numel() for p in per_rank]
    if got != list(lens):
        text = [b - a for a, b in runs if (a, b) != (image_lo, image_hi)]
        raise ValueError(
            f"context-parallel shards hold {list(lens)} tokens per rank; the pisa backend expects each token "
            f"stream (text {text}, image {image_hi - image_lo}) split evenly over the ranks, i.e. {got}"
        )
    model_of_gathered = torch.cat(per_rank)
    gathered_of_model = torch.empty_like(model_of_gathered)
    gathered_of_model[model_of_gathered] = torch.arange(total)
    return gathered_of_model[layout.perm]


def allow_cpu_context_parallel() -> None:
    """Let diffusers set up context parallelism on CPU ranks (gloo tests, ``--tiny`` benchmarks).

    diffusers picks each rank's device as ``rank % torch.accelerator.device_count()``, which divides
    by zero on a CPU-only torch; report one "device" (the CPU) instead. Process-wide: call it only
    in CPU test or benchmark processes.
    """
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1
