"""What one managed attention call computes (q/k/v ``[B, L, H, D]``).

:func:`attend` gets the layer index from the processor that calls it and asks the current
:class:`~.state.Run` (opened when the managed transformer's forward runs) what the call is:

* the layer's self-attention sequence (the tiled joint or image-only sequence): the
  :class:`~.schedule.Schedule` decides dense or sparse; sparse calls run
  :func:`pisa_attn.pisa_attention` on the image queries with text key blocks kept exact, text
  queries attend densely; an attention mask is reordered like the tokens; observers (``hooks``)
  see every managed call (with the valid keys per row of a key-padding mask, dense calls too, and
  the softmax scale used);
* a call outside its transformer's forward (the attention module called on its own), or of a
  length that is no managed sequence: exact attention, uncounted.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import spec
from ..attention import PisaPlan, pisa_attention, plan, run
from ..settings import PisaSettings
from ..layout import block_floor
from . import hooks
from .state import PisaState, Run, Sequence, current_run, key_lengths


def _empty_bshd(q: Tensor, v: Tensor) -> Tensor:
    b, lq, h, _ = q.shape
    return q.new_empty(b, lq, h, v.shape[-1])


# --- the attention call ------------------------------------------------------------------------
def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale, enable_gqa: bool) -> Tensor:
    """Exact attention on [B, L, H, D] tensors, as diffusers' native backend computes it."""
    if mask is not None and mask.dim() == 2 and mask.shape[0] == q.shape[0] and mask.shape[1] == k.shape[1]:
        mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2)


def _row_groups(lens: list[int] | None, batch: int, kv_len: int) -> list[tuple[object, int]]:
    """(rows, valid keys) groups: one group (all rows) unless rows differ in their valid keys."""
    if lens is None:
        return [(slice(None), kv_len)]
    groups: dict[int, list[int]] = defaultdict(list)
    for row, n in enumerate(lens):
        groups[n].append(row)
    if len(groups) == 1:
        return [(slice(None), lens[0])]
    return [(torch.tensor(rows), n) for n, rows in groups.items()]


def planned(plans: dict, q: Tensor, k: Tensor, settings: PisaSettings, keep: Tensor | None) -> PisaPlan:
    """The plan of a call of this shape (made once, then shared by every layer of that shape)."""
    n_keep = 0 if keep is None else int(keep.sum())
    key = (q.shape, k.shape, q.dtype, q.device, settings, n_keep)
    p = plans.get(key)
    if p is None:
        p = plans[key] = plan(q, k, settings, max_keep=n_keep)
    return p


# On CUDA the text queries' exact attention runs on a side stream, concurrently with PISA's
# statistics and selection, which are latency-bound launches that leave SMs idle (the text
# queries' few hundred rows fill less than a wave). False: both on the caller's stream, in turn.
TEXT_SIDE_STREAM = True
_SIDE = threading.local()  # per thread: device -> (side stream, fork event, join event), made once


def _text_stream(q: Tensor):
    """(side stream, fork event, join event) of ``q``'s device for the text queries, or None (the
    caller's stream). The events are reused, one set per thread: a call's wait is enqueued before
    its next record."""
    if not (TEXT_SIDE_STREAM and q.is_cuda) or torch.compiler.is_compiling():
        return None
    per_device = _SIDE.__dict__.setdefault("streams", {})
    got = per_device.get(q.device)
    if got is None:
        got = per_device[q.device] = (torch.cuda.Stream(q.device), torch.cuda.Event(), torch.cuda.Event())
    return got


def sparse_attention(q, k, v, seq: Sequence | None, lens, settings: PisaSettings, alpha=None,
                     plans: dict | None = None) -> Tensor:
    """PISA on the image queries (text key blocks kept exact), dense attention for text queries.

    The image queries run from the block boundary at or before the first of them, so their query
    blocks are the tiles the key blocks are (the text rows computed on the way are dropped). On
    CUDA the text queries run on a side stream joined before the return (:data:`TEXT_SIDE_STREAM`).

    ``lens``: valid (unmasked, leading) keys per batch row, or None. ``settings``: a
    ``"bshd"`` :class:`PisaSettings`. ``alpha``: the first-order weight of this layer (``run``'s).
    ``plans``: where the plans of the call shapes are kept (a managed transformer's); None runs
    :func:`pisa_attention` (its own plan cache). Returns [B, Lq, H, D].
    """
    if settings.layout != "bshd":
        raise ValueError(f"sparse_attention takes [B, L, H, D] tensors: settings.layout must be 'bshd', "
                         f"got {settings.layout!r}")
    bs = settings.block_size

    def attention(qq, kk, vv, keep, out=None):
        if plans is None:
            return pisa_attention(qq, kk, vv, settings=settings, keep_blocks=keep, alpha=alpha)
        return run(planned(plans, qq, kk, settings, keep), qq, kk, vv, keep_blocks=keep, alpha=alpha, out=out)

    lo, hi = (0, q.shape[1]) if seq is None else (seq.image_lo, seq.image_hi)
    texts = [] if seq is None else seq.text_ranges()
    groups = _row_groups(lens, q.shape[0], k.shape[1])
    if not texts and len(groups) == 1:  # image-only sequence (Wan): one call, no output copy
        n = groups[0][1]
        return attention(q, k[:, :n], v[:, :n], None if seq is None else seq.keep_for(n, bs))
    out = _empty_bshd(q, v)
    start = block_floor(lo, bs)  # query blocks on the key blocks' grid (see layout.block_floor)
    # Written in place (on a plan, one row group): PISA's rows [start, lo) are text rows computed on
    # the way, which the text queries' exact rows overwrite after it.
    in_place = plans is not None and len(groups) == 1
    side, fork, join = _text_stream(q) or (None, None, None)
    kvs = [(rows, n, k[rows, :n], v[rows, :n]) for rows, n in groups]
    if side is not None:
        main = torch.cuda.current_stream(q.device)
        fork.record(main)  # after the row gathers above, which run on the caller's stream
        side.wait_event(fork)
    late = []  # (rows, a, b, text rows' output) written after the PISA call
    try:
        for rows, n, kk, vv in kvs:
            for a, b in texts:
                after = in_place and a < hi and start < b
                # made on the caller's stream, which reads it after the join
                buf = out.new_empty(q.shape[0], b - a, q.shape[2], v.shape[-1]) if after and side is not None else None
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    t = dense_attention(q[rows, a:b], kk, vv, None, settings.scale, q.shape[2] != k.shape[2])
                    if not after:
                        out[rows, a:b] = t
                    elif buf is not None:
                        t = buf.copy_(t)
                if after:
                    late.append((rows, a, b, t))
        for rows, n, kk, vv in kvs:
            keep = None if seq is None else seq.keep_for(n, bs)
            if in_place:
                attention(q[:, start:hi], kk, vv, keep, out=out[:, start:hi])
            else:
                out[rows, lo:hi] = attention(q[rows, start:hi], kk, vv, keep)[:, lo - start :]
    finally:  # joined on every path: the side stream writes into memory the caller's stream owns
        if side is not None:
            join.record(side)
            main.wait_event(join)
    for rows, a, b, t in late:
        out[rows, a:b] = t
    return out


def attend(state: PisaState, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
           scale: float | None = None) -> Tensor:
    """Run one call of managed layer ``layer`` (see the module docstring for who decides what)."""
    run = current_run()
    seq = None if run is None or run.state is not state else run.sequence(q.shape[1], k.shape[1])
    if seq is None:
        if run is not None and mask is not None:  # its image queries (or keys) are in tiled order
            mask = run.image_mask(mask, q.shape[1], k.shape[1])
        return dense_attention(q, k, v, mask, scale, q.shape[2] != k.shape[2])
    if mask is not None:  # written for the model's token order; the tokens are in tiled order
        mask = run.tiled_mask(mask, seq, q.shape[0])
    reason = run.dense_reason(layer, k.shape[1])
    observed = bool(hooks.observers(state.transformer))
    # Sparse calls need the valid keys per row; so do observers of dense calls (telemetry must not
    # count padded keys, capture trims them), read from the mask the same way.
    lens = _run_key_lengths(run, mask, q.shape[0], k.shape[1]) if reason is None or observed else None
    if reason is not None:
        out = dense_attention(q, k, v, mask, scale, q.shape[2] != k.shape[2])
    else:
        settings = state.settings_for(layer, scale)
        out = sparse_attention(q, k, v, seq, lens, settings, alpha=state.alpha_for(layer), plans=state.plans)
    state.stats["sparse" if reason is None else "dense"] += 1
    if reason is not None:
        state.stats[reason] += 1
    if observed:
        _notify(run, seq, layer, reason, lens, scale, q, k, v, out)
    return out


def _run_key_lengths(run: Run, mask: Tensor | None, batch: int, kv_len: int):
    if mask is None:
        return None
    key = (mask.data_ptr(), tuple(mask.shape), mask.dtype)  # one mask per forward: read it once
    if key not in run.key_lens:
        run.key_lens[key] = key_lengths(mask, batch, kv_len)
    return run.key_lens[key]


def _notify(run: Run, seq: Sequence, layer: int, reason, lens, scale, q, k, v, out) -> None:
    state, cfg = run.state, run.state.config
    call = hooks.AttentionCall(
        model=state.adapter.name,
        layer=layer,
        step=run.step,
        q=q.transpose(1, 2),
        k=k.transpose(1, 2),
        v=v.transpose(1, 2),
        out=out.transpose(1, 2),
        dense=reason is not None,
        density=cfg.density,
        mode=cfg.mode,
        covariance_aware=state.covariance_for(layer, freeze=False),
        block_size=cfg.block_size,
        query_block=cfg.query_block,
        backend=cfg.call_settings.backend,
        precision=cfg.call_settings.precision,
        keep_blocks=seq.keep,
        scale=scale,  # None (the processors' default) becomes 1/sqrt(D), what SDPA and PISA used
        alpha=state.alpha_values(layer, q.shape[2]),
        meta={
            "token_layout": seq.layout,
            "text_len": seq.text_len,
            "grid": run.info.grid,
            "image_range": (seq.image_lo, seq.image_hi),
            "key_lens": lens,
            "dense_reason": reason,
            "block": state.blocks[layer],
            "n_select": spec.num_selected(cfg.density, math.ceil(k.shape[1] / cfg.block_size)),
        },
    )
    hooks.notify(state.transformer, call)
