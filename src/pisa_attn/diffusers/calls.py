"""What one call of the ``"pisa"`` backend computes (q/k/v ``[B, L, H, D]``).

:func:`attend` asks the current :class:`~.state.Run` (opened when a managed transformer's forward
runs) what the call is and runs it:

* managed self-attention (the adapter's layers, sequence length of the tiled joint or image-only
  sequence): the :class:`~.schedule.Schedule` decides dense or sparse; sparse calls run
  :func:`pisa_attn.pisa_attention` on the image queries with text key blocks kept exact, text
  queries attend densely; an attention mask is reordered like the tokens; observers (``hooks``)
  see every managed call (with the valid keys per row of a key-padding mask, dense calls too, and
  the softmax scale used);
* anything else (cross-attention, the Hunyuan token refiner): dense, uncounted;
* no run (the backend selected with ``set_attention_backend("pisa")`` on a transformer without
  :func:`apply_pisa`): self-attention calls of at least ``min_kv_len`` keys run sparse with the
  :func:`configure` defaults, in the model's own token order.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import spec, tail_weight
from ..attention import pisa_attention
from ..layout import block_floor
from . import hooks
from .schedule import DEFAULT_MIN_KV_LEN
from .state import Run, Sequence, current_run, key_lengths


def _empty_bshd(q: Tensor, v: Tensor) -> Tensor:
    b, lq, h, _ = q.shape
    return q.new_empty(b, lq, h, v.shape[-1])


# --- settings without apply_pisa -------------------------------------------------------------
@dataclass(frozen=True)
class BackendDefaults:
    density: float = 0.15
    mode: str = "hybrid"
    covariance_aware: bool = spec.DEFAULT_COVARIANCE_AWARE
    block_size: int = 64
    min_kv_len: int = DEFAULT_MIN_KV_LEN
    alpha: float | None = None


_defaults = BackendDefaults()


def configure(**settings) -> BackendDefaults:
    """Set the settings used when the backend runs on a transformer without :func:`apply_pisa`
    (``density``, ``mode``, ``covariance_aware``, ``block_size``, ``min_kv_len``, ``alpha``: a
    float or None, as :func:`pisa_attention`'s); returns them."""
    global _defaults
    unknown = set(settings) - set(BackendDefaults.__dataclass_fields__)
    if unknown:
        raise TypeError(f"configure() got unknown settings {sorted(unknown)}")
    new = BackendDefaults(**{**_defaults.__dict__, **settings})
    spec.check_settings(density=new.density, block_size=new.block_size, mode=new.mode,
                        covariance_aware=new.covariance_aware)
    if isinstance(new.min_kv_len, bool) or not isinstance(new.min_kv_len, int) or new.min_kv_len < 0:
        raise ValueError(f"min_kv_len must be an int >= 0, got {new.min_kv_len!r}")
    if isinstance(new.alpha, Tensor):
        raise TypeError("configure(alpha=...) takes a float or None (per-head weights need apply_pisa)")
    tail_weight.check(new.alpha, new.mode, 1)
    _defaults = new
    return new


# --- the attention call ------------------------------------------------------------------------
def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale, enable_gqa: bool) -> Tensor:
    """Exact attention on [B, L, H, D] tensors, as diffusers' native backend computes it."""
    if mask is not None and mask.dim() == 2 and mask.shape[0] == q.shape[0] and mask.shape[1] == k.shape[1]:
        mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2)


def pisa_kwargs(density: float, mode: str, covariance_aware: bool, block_size: int, scale, keep, alpha=None) -> dict:
    """The one place a dispatcher call becomes :func:`pisa_attention` keyword arguments."""
    return dict(
        density=density,
        mode=mode,
        covariance_aware=covariance_aware,
        block_size=block_size,
        scale=scale,
        layout="bshd",
        keep_blocks=keep,
        alpha=alpha,
    )


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


def sparse_attention(q, k, v, seq: Sequence | None, lens, scale, settings, alpha=None) -> Tensor:
    """PISA on the image queries (text key blocks kept exact), dense attention for text queries.

    The image queries run from the block boundary at or before the first of them, so their query
    blocks are the tiles the key blocks are (the text rows computed on the way are dropped).

    ``lens``: valid (unmasked, leading) keys per batch row, or None. ``settings``: density, mode,
    covariance_aware, block_size. ``alpha``: the first-order weight (:func:`pisa_attention`'s).
    Returns [B, Lq, H, D].
    """
    density, mode, cov, bs = settings
    lo, hi = (0, q.shape[1]) if seq is None else (seq.image_lo, seq.image_hi)
    texts = [] if seq is None else seq.text_ranges()
    groups = _row_groups(lens, q.shape[0], k.shape[1])
    if not texts and len(groups) == 1:  # image-only sequence (Wan): one call, no output copy
        n = groups[0][1]
        keep = None if seq is None else seq.keep_for(n, bs)
        return pisa_attention(q, k[:, :n], v[:, :n], **pisa_kwargs(density, mode, cov, bs, scale, keep, alpha))
    out = _empty_bshd(q, v)
    start = block_floor(lo, bs)  # query blocks on the key blocks' grid (see layout.block_floor)
    for rows, n in groups:
        kk, vv = k[rows, :n], v[rows, :n]
        keep = None if seq is None else seq.keep_for(n, bs)
        kw = pisa_kwargs(density, mode, cov, bs, scale, keep, alpha)
        out[rows, lo:hi] = pisa_attention(q[rows, start:hi], kk, vv, **kw)[:, lo - start :]
        for a, b in texts:
            out[rows, a:b] = dense_attention(q[rows, a:b], kk, vv, None, scale, q.shape[2] != k.shape[2])
    return out


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale, enable_gqa: bool) -> Tensor:
    """Run one dispatcher call (see the module docstring for who decides what)."""
    run = current_run()
    if run is None:
        return _attend_unmanaged(q, k, v, mask, scale, enable_gqa)
    seq = run.sequence(q.shape[1], k.shape[1])
    if seq is None:  # cross-attention, text refiner, ...: not one of PISA's layers
        if mask is not None:  # its image queries (or keys) are in tiled order too
            mask = run.image_mask(mask, q.shape[1], k.shape[1])
        return dense_attention(q, k, v, mask, scale, enable_gqa)
    if mask is not None:  # written for the model's token order; the tokens are in tiled order
        mask = run.tiled_mask(mask, seq, q.shape[0])
    state, cfg = run.state, run.state.config
    layer = run.next_layer()
    reason = run.dense_reason(layer, k.shape[1])
    observed = bool(hooks.observers(state.transformer))
    # Sparse calls need the valid keys per row; so do observers of dense calls (telemetry must not
    # count padded keys, capture trims them), read from the mask the same way.
    lens = _run_key_lengths(run, mask, q.shape[0], k.shape[1]) if reason is None or observed else None
    if reason is not None:
        out = dense_attention(q, k, v, mask, scale, enable_gqa)
    else:
        settings = (cfg.density, cfg.mode, state.covariance_for(layer), cfg.block_size)
        out = sparse_attention(q, k, v, seq, lens, scale, settings, alpha=state.alpha_for(layer))
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


def _attend_unmanaged(q, k, v, mask, scale, enable_gqa):
    d = _defaults
    if q.shape[1] != k.shape[1] or k.shape[1] < d.min_kv_len:
        return dense_attention(q, k, v, mask, scale, enable_gqa)
    lens = None if mask is None else key_lengths(mask, q.shape[0], k.shape[1])
    return sparse_attention(q, k, v, None, lens, scale, (d.density, d.mode, d.covariance_aware, d.block_size),
                            alpha=d.alpha)


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
        keep_blocks=seq.keep,
        scale=scale,  # None (the dispatcher's default) becomes 1/sqrt(D), what SDPA and PISA used
        alpha=state.alpha_values(layer, q.shape[2]),
        meta={
            "token_layout": seq.layout,
            "text_len": seq.text_len,
            "grid": run.info.grid,
            "image_range": (seq.image_lo, seq.image_hi),
            "key_lens": lens,
            "dense_reason": reason,
            "block": run.block(layer),
            "n_select": spec.num_selected(cfg.density, math.ceil(k.shape[1] / cfg.block_size)),
        },
    )
    hooks.notify(state.transformer, call)
