"""PISA's attention processors, one per transformer family, set per managed module with
diffusers' public ``set_processor``.

Each computes what the family's own processor computes (same projections, q/k norms, rotary
embeddings, text/image concatenation and output projections) and hands q/k/v ``[B, L, H, D]`` to
:func:`.backend.attention` with the layer index it was given when :func:`apply_pisa` installed it
(no call counting). It keeps the processor it replaces, which :func:`remove_pisa` puts back.

``_attention_backend`` and ``_parallel_config`` are the attributes diffusers sets on processors
(``set_attention_backend``, ``enable_parallelism``): the first is ignored (PISA is the backend of a
managed layer), the second makes calls run context-parallel.

A processor whose state was removed but that diffusers still calls (it keeps copies of processors,
e.g. SD3's ``fuse_qkv_projections`` / ``unfuse_qkv_projections`` put back the ones it saw) runs the
processor it replaced, as the model would without PISA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import backend
from .state import state_alive


class PisaProcessor:
    """Base of the family processors: the replaced processor, the state handle, the layer index."""

    # The classes of diffusers processors this one replaces (by name, see ``replaces``).
    replaces: tuple[str, ...] = ()
    # Whether the replaced processor reads ``attn.fused_projections`` (then fused q/k/v are refused).
    reads_fused: bool = True

    def __init__(self, original, handle: int, layer: int) -> None:
        self.original = original
        self.handle = handle
        self.layer = layer
        self._attention_backend = getattr(original, "_attention_backend", None)
        self._parallel_config = getattr(original, "_parallel_config", None)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q/k/v ``[B, L, H, D]`` -> ``[B, L, H * D]`` in q's dtype."""
        out = backend.attention(self.handle, self.layer, q, k, v, mask, self._parallel_config)
        return out.flatten(2, 3).to(q.dtype)

    def orphaned(self) -> bool:
        """Removed (remove_pisa) but still called: eagerly, the replaced processor runs instead."""
        return not torch.compiler.is_compiling() and not state_alive(self.handle)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer={self.layer}, replaces={type(self.original).__name__})"


def _heads(x: Tensor, heads: int) -> Tensor:
    return x.unflatten(-1, (heads, -1))


def _added_projections(attn) -> tuple:
    return attn.add_q_proj, attn.add_k_proj, attn.add_v_proj


def _rope(x: Tensor, rotary) -> Tensor:
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, rotary, sequence_dim=1)


class FluxProcessor(PisaProcessor):
    """``FluxAttnProcessor``: ``[text, image]`` joint attention (double blocks), or the single
    blocks' already concatenated stream; rotary embeddings over the whole sequence."""

    replaces = ("FluxAttnProcessor", "FluxAttnProcessor2_0")

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, image_rotary_emb=None) -> Tensor:
        if self.orphaned():
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        h = attn.heads
        q, k, v = (_heads(p(hidden_states), h) for p in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
            eq, ek, ev = (_heads(p(encoder_hidden_states), h) for p in _added_projections(attn))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
        if image_rotary_emb is not None:
            q, k = _rope(q, image_rotary_emb), _rope(k, image_rotary_emb)
        out = self.attention(q, k, v, attention_mask)
        if encoder_hidden_states is None:
            return out
        n_text = encoder_hidden_states.shape[1]
        context, out = out.split_with_sizes([n_text, out.shape[1] - n_text], dim=1)
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(context.contiguous())


class JointProcessor(PisaProcessor):
    """SD3's ``JointAttnProcessor2_0``: ``[image, text]`` joint attention (``attn``), or image-only
    self-attention (SD3.5's ``attn2``). Like the original it takes no mask."""

    replaces = ("JointAttnProcessor2_0",)
    reads_fused = False  # SD3 fuses by swapping in another processor (refused by its class)

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, *args, **kwargs):
        if self.orphaned():
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        h, n_image = attn.heads, hidden_states.shape[1]
        q, k, v = (_heads(p(hidden_states), h) for p in (attn.to_q, attn.to_k, attn.to_v))
        q = q if attn.norm_q is None else attn.norm_q(q)
        k = k if attn.norm_k is None else attn.norm_k(k)
        if encoder_hidden_states is not None:
            eq, ek, ev = (_heads(p(encoder_hidden_states), h) for p in _added_projections(attn))
            eq = eq if attn.norm_added_q is None else attn.norm_added_q(eq)
            ek = ek if attn.norm_added_k is None else attn.norm_added_k(ek)
            q, k, v = torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)
        out = self.attention(q, k, v, None)
        context = None
        if encoder_hidden_states is not None:
            out, context = out[:, :n_image], out[:, n_image:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if encoder_hidden_states is None else (out, context)


def _wan_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanProcessor(PisaProcessor):
    """``WanAttnProcessor`` of a self-attention layer (``attn1``): q/k norms over all heads, then
    Wan's interleaved rotary embedding."""

    replaces = ("WanAttnProcessor", "WanAttnProcessor2_0")

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, rotary_emb=None) -> Tensor:
        if self.orphaned():
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if encoder_hidden_states is not None:
            raise ValueError("PISA manages Wan's self-attention (attn1); it got a cross-attention call")
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (_heads(x, attn.heads) for x in (q, k, v))
        if rotary_emb is not None:
            q, k = _wan_rope(q, *rotary_emb), _wan_rope(k, *rotary_emb)
        out = self.attention(q, k, v, attention_mask)
        return attn.to_out[1](attn.to_out[0](out))


class HunyuanProcessor(PisaProcessor):
    """``HunyuanVideoAttnProcessor2_0``: ``[video, text]`` joint attention, rotary embeddings on the
    video tokens only."""

    replaces = ("HunyuanVideoAttnProcessor2_0",)

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, image_rotary_emb=None):
        if self.orphaned():
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        h = attn.heads
        concat = attn.add_q_proj is None and encoder_hidden_states is not None
        if concat:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        q, k, v = (_heads(p(hidden_states), h) for p in (attn.to_q, attn.to_k, attn.to_v))
        q = q if attn.norm_q is None else attn.norm_q(q)
        k = k if attn.norm_k is None else attn.norm_k(k)
        if image_rotary_emb is not None:
            if concat:
                n = encoder_hidden_states.shape[1]
                q = torch.cat([_rope(q[:, :-n], image_rotary_emb), q[:, -n:]], dim=1)
                k = torch.cat([_rope(k[:, :-n], image_rotary_emb), k[:, -n:]], dim=1)
            else:
                q, k = _rope(q, image_rotary_emb), _rope(k, image_rotary_emb)
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            eq, ek, ev = (_heads(p(encoder_hidden_states), h) for p in _added_projections(attn))
            eq = eq if attn.norm_added_q is None else attn.norm_added_q(eq)
            ek = ek if attn.norm_added_k is None else attn.norm_added_k(ek)
            q, k, v = torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)
        out = self.attention(q, k, v, attention_mask)
        if encoder_hidden_states is None:
            return out, encoder_hidden_states
        n = encoder_hidden_states.shape[1]
        out, context = out[:, :-n], out[:, -n:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            context = attn.to_add_out(context)
        return out, context


PROCESSORS: dict[str, type[PisaProcessor]] = {
    "flux": FluxProcessor, "sd3": JointProcessor, "wan": WanProcessor, "hunyuan": HunyuanProcessor,
}


def check_replaceable(family: str, name: str, module) -> None:
    """ValueError unless ``module``'s processor is the family's diffusers processor PISA rewrites
    (a custom, IP-adapter or fused-projection processor computes something else)."""
    cls = PROCESSORS[family]
    proc = module.processor
    if isinstance(proc, PisaProcessor):  # managed already: apply_pisa replaces it
        proc = proc.original
    if type(proc).__name__ not in cls.replaces:
        raise ValueError(
            f"attention module {name!r} uses {type(proc).__name__}; PISA replaces only {' / '.join(cls.replaces)} "
            f"in this model (reset custom, IP-adapter or other attention processors first)"
        )
    if cls.reads_fused and getattr(module, "fused_projections", False):
        raise ValueError(f"attention module {name!r} has fused q/k/v projections: call unfuse_qkv_projections() "
                         f"before apply_pisa")
