"""Per-model facts for the diffusers integration, one small adapter per transformer family.

An adapter says where the image/video tokens are created and consumed (module names), how to read
the token grid, the text length and the timestep from a forward call, which attention modules are
the managed self-attention layers, and the paper's warm-up defaults (appendix D). Adding a model
family means adding one :class:`ModelAdapter` to :data:`ADAPTERS`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor


class CallShape(NamedTuple):
    """What a forward call's argument shapes say (read while tracing too: shapes only)."""

    grid: tuple[int, ...] | None  # token grid after patchification; None: read from ``grid_input``
    text_len: int  # text tokens in the joint self-attention sequence (0: no joint text)
    image_tokens: int  # image/video tokens in the call


@dataclass(frozen=True)
class CallInfo:
    """One forward call as PISA's attention sees it (read when the call runs)."""

    grid: tuple[int, ...]  # token grid after patchification: (h, w) or (t, h, w)
    text_len: int  # text tokens in the joint self-attention sequence (0: no joint text)
    timestep: float  # the call's (largest) timestep, for step tracking


@dataclass(frozen=True)
class ModelAdapter:
    """Where PISA hooks into one transformer class.

    text:           position of the text tokens in the joint self-attention sequence
                    ("before", "after" or "none").
    token_module:   submodule whose output carries the image tokens; ``token_output`` says its
                    form: "tokens" ([B, L, C], reordered along dim 1) or "conv" ([B, C, *grid]
                    patch-embedding output, returned as [B, C, 1, .., 1, L] in tiled order so the
                    model's own ``flatten(2).transpose(1, 2)`` yields tiled tokens).
    rope_module:    submodule returning per-token rotary tensors (cos, sin) with tokens on
                    ``rope_dim``; ``rope_text_before``: they also cover the text tokens first.
    untile_module:  submodule whose output ([B, L, C], last per-token step before unpatchify) is
                    put back in original order.
    token_inputs:   forward arguments holding image-token tensors [B, L, ...] (or lists of them:
                    ControlNet residuals, per-token timesteps) reordered on entry.
    attention:      ``fnmatch`` patterns of the managed self-attention modules.
    read_shape:     (transformer, bound arguments) -> :class:`CallShape`, from shapes only (it runs
                    inside ``torch.compile`` graphs).
    grid_input:     argument whose values give the grid when the shapes cannot (FLUX's ``img_ids``),
                    read by ``read_grid(tensor, per-state cache)`` when the call runs.
    skipped_blocks: indices of the transformer blocks a forward call skips (SD3's skip-layer
                    guidance), from its bound arguments.
    """

    name: str
    class_name: str
    ndim: int
    text: str
    token_module: str
    token_output: str
    rope_module: str | None
    rope_dim: int
    rope_text_before: bool
    attention: tuple[str, ...]
    read_shape: Callable[[Any, dict], CallShape]
    defaults: Callable[[Any], dict]
    check: Callable[[Any], None] = lambda transformer: None
    token_inputs: tuple[str, ...] = ()
    untile_module: str = "proj_out"
    image_model: bool = field(default=False)
    skipped_blocks: Callable[[dict], frozenset[int]] = lambda arguments: frozenset()
    grid_input: str | None = None
    read_grid: Callable[[Tensor, dict], tuple[int, ...]] | None = None


def timestep_value(timestep) -> float:
    """Largest timestep of a call (one host read): per-sample or per-token timesteps share it."""
    if not isinstance(timestep, Tensor):
        return float(timestep)
    return float(timestep.detach().max())


def _shape(grid: tuple[int, ...], text_len: int) -> CallShape:
    return CallShape(grid, text_len, math.prod(grid))


def _video_grid(x: Tensor, pt: int, ph: int, pw: int) -> tuple[int, int, int]:
    if x.dim() != 5:
        raise ValueError(f"hidden_states must be a [B, C, F, H, W] video latent, got shape {tuple(x.shape)}")
    f, h, w = x.shape[2:]
    return (f // pt, h // ph, w // pw)


# --- FLUX.1 -----------------------------------------------------------------------------------
class _IdsGrid:
    """Grid of FLUX's packed tokens from ``img_ids`` (rows (0, y, x) in raster order), read once
    per ids tensor (the pipeline builds it once per generation) and again when it is written in
    place (its version counter moves)."""

    def __init__(self) -> None:
        self._ref = None
        self._version = -1
        self._grid: tuple[int, int] | None = None

    def __call__(self, ids: Tensor) -> tuple[int, int]:
        if ids.is_inference():  # made under torch.inference_mode(): no version counter, read it each time
            return _raster_ids_grid(ids)
        if self._ref is not None and self._ref() is ids and self._version == ids._version:
            return self._grid
        grid = _raster_ids_grid(ids)
        self._ref, self._version, self._grid = weakref.ref(ids), ids._version, grid
        return grid


def _raster_ids_grid(ids: Tensor) -> tuple[int, int]:
    if ids.dim() == 3:
        ids = ids[0]
    if ids.dim() != 2 or ids.shape[1] != 3:
        raise ValueError(f"img_ids must have shape [L, 3], got {tuple(ids.shape)}")
    n = ids.shape[0]
    h, w = (int(v) + 1 for v in ids[:, 1:].max(0).values.tolist())
    flat = ids[:, 1].long() * w + ids[:, 2].long()
    raster = h * w == n and bool(((ids[:, 0] == 0) & (flat == torch.arange(n, device=ids.device))).all())
    if not raster:
        raise ValueError(
            "img_ids must describe one image grid in raster order ((0, y, x) rows, as FluxPipeline builds "
            "them); reference-image tokens (FLUX Kontext) and other id layouts are not supported by PISA tiling"
        )
    return h, w


def _flux_shape(transformer, a: dict) -> CallShape:
    return CallShape(None, a["encoder_hidden_states"].shape[1], a["hidden_states"].shape[1])


FLUX = ModelAdapter(
    name="flux",
    class_name="FluxTransformer2DModel",
    ndim=2,
    text="before",
    token_module="x_embedder",
    token_output="tokens",
    rope_module="pos_embed",
    rope_dim=0,
    rope_text_before=True,
    attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
    read_shape=_flux_shape,
    defaults=lambda config: {"dense_layers": 4, "dense_steps": 0, "covariance_aware": True},
    token_inputs=("controlnet_block_samples", "controlnet_single_block_samples"),
    image_model=True,
    grid_input="img_ids",
    read_grid=lambda ids, cache: cache.setdefault("ids_grid", _IdsGrid())(ids),
)


# --- Stable Diffusion 3 / 3.5 -------------------------------------------------------------------
def _sd3_shape(transformer, a: dict) -> CallShape:
    x = a["hidden_states"]
    if x.dim() != 4:
        raise ValueError(f"hidden_states must be a [B, C, H, W] latent, got shape {tuple(x.shape)}")
    p = transformer.config.patch_size
    return _shape((x.shape[2] // p, x.shape[3] // p), a["encoder_hidden_states"].shape[1])


SD3 = ModelAdapter(
    name="sd3",
    class_name="SD3Transformer2DModel",
    ndim=2,
    text="after",
    token_module="pos_embed",
    token_output="tokens",
    rope_module=None,
    rope_dim=0,
    rope_text_before=False,
    # attn2: SD3.5-medium's extra image-only self-attention in its first blocks.
    attention=("transformer_blocks.*.attn", "transformer_blocks.*.attn2"),
    read_shape=_sd3_shape,
    defaults=lambda config: {"dense_layers": 4, "dense_steps": 0, "covariance_aware": True},
    token_inputs=("block_controlnet_hidden_states",),
    image_model=True,
    skipped_blocks=lambda a: frozenset(a.get("skip_layers") or ()),
)


# --- Wan2.1 ------------------------------------------------------------------------------------
def _wan_shape(transformer, a: dict) -> CallShape:
    return _shape(_video_grid(a["hidden_states"], *transformer.config.patch_size), 0)


def _wan_defaults(config) -> dict:
    # Appendix D: 1.3B (hidden size 1536) 15 dense steps, 14B (5120) 10; one dense layer each.
    width = config.num_attention_heads * config.attention_head_dim
    return {"dense_layers": 1, "dense_steps": 15 if width <= 2048 else 10, "covariance_aware": False}


WAN = ModelAdapter(
    name="wan",
    class_name="WanTransformer3DModel",
    ndim=3,
    text="none",  # text enters through cross-attention (attn2), which stays dense
    token_module="patch_embedding",
    token_output="conv",
    rope_module="rope",
    rope_dim=1,
    rope_text_before=False,
    attention=("blocks.*.attn1",),
    read_shape=_wan_shape,
    defaults=_wan_defaults,
    token_inputs=("timestep",),  # Wan2.2 TI2V per-token timesteps [B, L]; 1-D timesteps untouched
)


# --- HunyuanVideo ------------------------------------------------------------------------------
def _hunyuan_shape(transformer, a: dict) -> CallShape:
    c = transformer.config
    grid = _video_grid(a["hidden_states"], c.patch_size_t, c.patch_size, c.patch_size)
    return _shape(grid, a["encoder_hidden_states"].shape[1])


def _hunyuan_check(transformer) -> None:
    kind = getattr(transformer.config, "image_condition_type", None)
    if kind == "token_replace":
        raise ValueError(
            "HunyuanVideo with image_condition_type='token_replace' (I2V) treats the first frame's tokens "
            "as a contiguous prefix, which PISA's token tiling breaks; it is not supported"
        )


HUNYUAN = ModelAdapter(
    name="hunyuan",
    class_name="HunyuanVideoTransformer3DModel",
    ndim=3,
    text="after",
    token_module="x_embedder",
    token_output="tokens",
    rope_module="rope",
    rope_dim=0,
    rope_text_before=False,
    # Not context_embedder.token_refiner: the text-only refiner keeps its own processor (dense).
    attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
    read_shape=_hunyuan_shape,
    defaults=lambda config: {"dense_layers": 1, "dense_steps": 10, "covariance_aware": False},
    check=_hunyuan_check,
)

ADAPTERS: tuple[ModelAdapter, ...] = (FLUX, SD3, WAN, HUNYUAN)


def adapter_for(transformer) -> ModelAdapter:
    """The adapter of ``transformer``'s class (matched by name along its MRO, so subclasses work)."""
    names = [cls.__name__ for cls in type(transformer).__mro__]
    for name in names:
        for adapter in ADAPTERS:
            if adapter.class_name == name:
                return adapter
    supported = ", ".join(a.class_name for a in ADAPTERS)
    raise TypeError(f"PISA has no adapter for {type(transformer).__name__}; supported transformers: {supported}")


def transformers_of(obj) -> tuple[list[tuple[str, Any]], Any]:
    """``([(name, transformer), ...], pipeline or None)`` for a pipeline (its ``transformer`` and
    ``transformer_2``) or one transformer; ``torch.compile`` wrappers are seen through."""
    if isinstance(obj, torch.nn.Module):
        return [("transformer", getattr(obj, "_orig_mod", obj))], None
    found = [(n, getattr(obj, n, None)) for n in ("transformer", "transformer_2")]
    found = [(n, getattr(t, "_orig_mod", t)) for n, t in found if isinstance(t, torch.nn.Module)]
    found = [(n, t) for i, (n, t) in enumerate(found) if all(t is not u for _, u in found[:i])]  # one model twice
    if not found:
        raise TypeError(
            f"pipe_or_transformer must be a diffusers pipeline with a transformer or a transformer model, "
            f"got {type(obj).__name__}"
        )
    return found, obj
