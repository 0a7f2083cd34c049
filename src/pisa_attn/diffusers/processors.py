"""SD3's attention processor on diffusers' attention dispatcher.

SD3's ``JointAttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` itself, so no dispatcher
backend can reach it: ``set_attention_backend("pisa")`` and ``attention_backend("pisa")`` would
silently keep SDPA. :func:`route_joint_processor` (run when the backend registers) gives the class
the ``_attention_backend`` attribute the other processors have and sends its calls through
:func:`joint_attention` whenever the backend in effect for them is ``"pisa"``; with any other
backend it runs unchanged.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn
from diffusers.models.attention_processor import JointAttnProcessor2_0


def _project(x: torch.Tensor, heads: int, to_q, to_k, to_v, norm_q, norm_k):
    """q, k, v as [B, L, H, D] from one token stream (image or text), with its q/k norms."""
    q, k, v = (proj(x).unflatten(-1, (heads, -1)) for proj in (to_q, to_k, to_v))
    return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v


def joint_attention(attn, hidden_states, encoder_hidden_states, backend, parallel_config=None):
    """What ``JointAttnProcessor2_0`` computes (same projections, norms and ``[image, text]``
    concatenation, no mask), in the dispatcher's ``[B, L, H, D]`` layout through
    ``dispatch_attention_fn``."""
    n_image = hidden_states.shape[1]
    query, key, value = _project(hidden_states, attn.heads, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
    if encoder_hidden_states is not None:
        eq, ek, ev = _project(encoder_hidden_states, attn.heads, attn.add_q_proj, attn.add_k_proj,
                              attn.add_v_proj, attn.norm_added_q, attn.norm_added_k)  # fmt: skip
        query = torch.cat([query, eq], dim=1)
        key = torch.cat([key, ek], dim=1)
        value = torch.cat([value, ev], dim=1)

    out = dispatch_attention_fn(query, key, value, backend=backend, parallel_config=parallel_config)
    out = out.flatten(2, 3).to(query.dtype)

    context = None
    if encoder_hidden_states is not None:
        out, context = out[:, :n_image], out[:, n_image:]
        if not attn.context_pre_only:
            context = attn.to_add_out(context)
    out = attn.to_out[1](attn.to_out[0](out))
    return out if encoder_hidden_states is None else (out, context)


def route_joint_processor(member) -> None:
    """Make ``JointAttnProcessor2_0`` follow the ``member`` ("pisa") backend (idempotent)."""
    cls = JointAttnProcessor2_0
    if getattr(cls.__call__, "_pisa_original", None) is not None:
        return
    original = cls.__call__

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        backend = self._attention_backend or _AttentionBackendRegistry._active_backend
        if backend != member:
            return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        # Like the original, no mask: SD3's joint attention never passes one.
        return joint_attention(attn, hidden_states, encoder_hidden_states, member, self._parallel_config)

    __call__._pisa_original = original
    __call__.__doc__ = original.__doc__
    cls.__call__ = __call__
    cls._attention_backend = None  # set_attention_backend / apply_pisa set it per instance
    cls._parallel_config = None
