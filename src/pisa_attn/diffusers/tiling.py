"""Model-boundary token reordering: image/video tokens enter the blocks in tiled order once per
forward (with their rotary embeddings) and leave in original order before unpatchify.

Hooks: a transformer forward pre-hook reads the call (grid, text length, timestep), opens the
:class:`~.state.Run` and reorders token-shaped inputs; forward hooks on the adapter's token,
rotary and output modules reorder their outputs; a final transformer hook closes the run. Text
tokens are never moved, so the joint sequence is ``[text_before][tiled image][text_after]``.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor

from ..layout import TokenLayout, make_layout
from .models import CallInfo
from .parallel import tokens_stay_in_model_order
from .state import Layouts, PisaState, Run, Sequence, current_run, enter_run, exit_run


def default_tile(ndim: int, block_size: int) -> tuple[int, ...]:
    """A tile of ``block_size`` tokens (powers of two spread over the axes, width first):
    64 -> 8x8 / 4x4x4, 16 -> 4x4 / 2x2x4."""
    bits = int(math.log2(block_size))
    exp = [0] * ndim
    for i in range(bits):
        exp[ndim - 1 - i % ndim] += 1
    return tuple(2**e for e in exp)


def _sequence(layout: TokenLayout, text_before: int, n_image: int, block_size: int) -> Sequence:
    keep = layout.keep_blocks(block_size) if layout.num_text_tokens else None
    return Sequence(layout, layout.num_text_tokens, text_before, text_before + n_image, keep)


def build_layouts(grid: tuple[int, ...], text_len: int, text: str, tile: tuple[int, ...], block_size: int) -> Layouts:
    """Layouts of one grid. The hooks move only image tokens (text stays where the model puts it),
    so the joint layout uses the "compact_inplace" order: text in place, full tiles on block
    boundaries of the joint sequence. The image stream's layout is the same order offset by the
    text before it, so its permutation is exactly the image part of the joint one; the image-only
    sequence (SD3.5's attn2, text after: offset 0) counts blocks from its own first token."""
    before = text_len if text == "before" else 0
    after = text_len if text == "after" else 0
    image = make_layout(grid, tile=tile, order="compact_inplace", offset=before)
    joint = make_layout(grid, tile=tile, text_before=before, text_after=after, order="compact_inplace")
    n = image.num_tokens
    return Layouts(image, _sequence(joint, before, n, block_size), _sequence(image, 0, n, block_size))


# --- hooks -------------------------------------------------------------------------------------
def _active(state: PisaState) -> Run | None:
    run = current_run()
    if tokens_stay_in_model_order(state.transformer):  # context parallelism: attention tiles (issue 6)
        return None
    return run if run is not None and run.state is state else None


def _tile_token_input(layout: TokenLayout, x):
    n = layout.num_tokens
    if isinstance(x, Tensor):
        return layout.to_tiled(x, 1) if x.dim() >= 2 and x.shape[1] == n else x
    if isinstance(x, (list, tuple)):
        return type(x)(_tile_token_input(layout, t) for t in x)
    return x


def _pre_hook(state: PisaState, signature: inspect.Signature):
    adapter, cfg = state.adapter, state.config

    def hook(module, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        info: CallInfo = adapter.read_call(module, bound.arguments, state.read_cache)
        key = (info.grid, info.text_len)
        layouts = state.layouts.get(key)
        if layouts is None:
            layouts = build_layouts(info.grid, info.text_len, adapter.text, cfg.tile, cfg.block_size)
            state.layouts[key] = layouts
        previous = state.tracker.step
        step = state.tracker.observe(info.timestep)
        if step == 0 and previous != 0:  # a new generation (also detected without the pipeline hook)
            state.stats.clear()
        changed = False
        for name in adapter.token_inputs:
            if bound.arguments.get(name) is not None and not tokens_stay_in_model_order(module):  # issue 6
                new = _tile_token_input(layouts.image, bound.arguments[name])
                changed |= new is not bound.arguments[name]
                bound.arguments[name] = new
        run = Run(state, step, info, layouts, state.forward_blocks(bound.arguments))
        state.runs.append((enter_run(run), run))
        return (bound.args, bound.kwargs) if changed else None

    return hook


def _post_hook(state: PisaState):
    def hook(module, args, output):
        # Also called when the forward raised; pop only a run this transformer's pre-hook opened.
        if state.runs and current_run() is state.runs[-1][1]:
            exit_run(state.runs.pop()[0])
        return None

    return hook


def _token_hook(state: PisaState, kind: str):
    def hook(module, args, out):
        run = _active(state)
        if run is None:
            return None
        layout = run.layouts.image
        if kind == "tokens":
            return layout.to_tiled(out, 1)
        # Patch-embedding conv output [B, C, *grid]: flatten(2) is the raster token order.
        tiled = layout.to_tiled(out.flatten(2), 2)
        return tiled.reshape(*out.shape[:2], *([1] * (out.dim() - 3)), tiled.shape[-1])

    return hook


def _rope_hook(state: PisaState, dim: int, text_before: bool):
    def tile(run: Run, x: Tensor) -> Tensor:
        if not text_before:
            return run.layouts.image.to_tiled(x, dim)
        t = run.info.text_len
        text, image = x.narrow(dim, 0, t), x.narrow(dim, t, x.shape[dim] - t)
        return torch.cat([text, run.layouts.image.to_tiled(image, dim)], dim=dim)

    def hook(module, args, out):
        run = _active(state)
        if run is None:
            return None
        if isinstance(out, Tensor):
            return tile(run, out)
        return type(out)(tile(run, x) for x in out)

    return hook


def _untile_hook(state: PisaState):
    def hook(module, args, out):
        run = _active(state)
        return None if run is None else run.layouts.image.from_tiled(out, 1)

    return hook


def install(state: PisaState) -> None:
    """Register the boundary hooks of ``state.adapter`` on ``state.transformer``."""
    tr, ad = state.transformer, state.adapter
    signature = inspect.signature(tr.forward)
    h = state.handles
    h.append(tr.register_forward_pre_hook(_pre_hook(state, signature), with_kwargs=True))
    h.append(tr.register_forward_hook(_post_hook(state), always_call=True))
    h.append(tr.get_submodule(ad.token_module).register_forward_hook(_token_hook(state, ad.token_output)))
    if ad.rope_module is not None:
        rope = tr.get_submodule(ad.rope_module)
        h.append(rope.register_forward_hook(_rope_hook(state, ad.rope_dim, ad.rope_text_before)))
    h.append(tr.get_submodule(ad.untile_module).register_forward_hook(_untile_hook(state)))

