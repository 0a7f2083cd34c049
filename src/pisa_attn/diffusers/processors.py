"""Attention processors that route through diffusers' dispatcher where diffusers' own do not.

SD3's ``JointAttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` directly, so no dispatcher
backend (PISA included) can reach it. :class:`DispatchJointAttnProcessor` computes the same
attention (same projections, norms and ``[image, text]`` concatenation) in the dispatcher's
``[B, L, H, D]`` layout and calls ``dispatch_attention_fn``.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn


def _project(x: torch.Tensor, heads: int, to_q, to_k, to_v, norm_q, norm_k):
    """q, k, v as [B, L, H, D] from one token stream (image or text), with its q/k norms."""
    q, k, v = (proj(x).unflatten(-1, (heads, -1)) for proj in (to_q, to_k, to_v))
    return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v


class DispatchJointAttnProcessor:
    """Drop-in for SD3's ``JointAttnProcessor2_0`` (self-attention of image tokens, optionally
    joint with text tokens appended after them) that calls the attention dispatcher."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        # Like JointAttnProcessor2_0, no mask: SD3's joint attention never passes one.
        n_image = hidden_states.shape[1]
        query, key, value = _project(hidden_states, attn.heads, attn.to_q, attn.to_k, attn.to_v,
                                     attn.norm_q, attn.norm_k)
        if encoder_hidden_states is not None:
            eq, ek, ev = _project(encoder_hidden_states, attn.heads, attn.add_q_proj, attn.add_k_proj,
                                  attn.add_v_proj, attn.norm_added_q, attn.norm_added_k)
            query = torch.cat([query, eq], dim=1)
            key = torch.cat([key, ek], dim=1)
            value = torch.cat([value, ev], dim=1)

        out = dispatch_attention_fn(
            query, key, value, backend=self._attention_backend, parallel_config=self._parallel_config
        )
        out = out.flatten(2, 3).to(query.dtype)

        context = None
        if encoder_hidden_states is not None:
            out, context = out[:, :n_image], out[:, n_image:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if encoder_hidden_states is None else (out, context)
