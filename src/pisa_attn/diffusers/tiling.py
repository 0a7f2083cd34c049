"""Model-boundary token reordering: image/video tokens enter the blocks in tiled order once per
forward (with their rotary embeddings) and leave in original order before unpatchify.

Hooks: a transformer forward pre-hook (PyTorch's, which runs before every diffusers hook on the
model, so it sees the whole sequence also when context parallelism splits it in a diffusers hook)
reads the call's shapes, calls the opaque op ``pisa_attn::diffusers_begin_forward`` and reorders
token-shaped inputs with the permutation it returns; diffusers ``ModelHook``s named
:data:`HOOK_NAME` on the adapter's token and rotary modules reorder their outputs; the output
module's hook calls ``pisa_attn::diffusers_end_forward``, which puts the tokens back and closes the
run. Text tokens are never moved, so the joint sequence is ``[text_before][tiled image][text_after]``.

Everything that depends on values (the timestep and so the denoising step, FLUX's grid from
``img_ids``, the layouts, the :class:`~.state.Run` the attention processors read) happens inside the
two ops, when they run: under ``torch.compile(transformer, fullgraph=True)`` the graph holds the ops
and ``index_select`` calls with their outputs, and nothing in it changes from step to step.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
from torch import Tensor

from ..layout import TokenOrder, make_layout
from ..settings import as_int
from .models import CallInfo, timestep_value
from .parallel import check_no_tensor_parallel, check_token_split, tokens_stay_in_model_order
from .state import Layouts, PisaState, Run, Sequence, close_run, open_run, state_of


def default_tile(ndim: int, block_size: int) -> tuple[int, ...]:
    """A tile of ``block_size`` tokens (powers of two spread over the axes, width first):
    64 -> 8x8 / 4x4x4, 16 -> 4x4 / 2x2x4."""
    ndim = as_int("ndim", ndim, "an int (axes of the token grid)")  # numpy ints too
    if ndim < 1:
        raise ValueError(f"ndim must be an int >= 1 (axes of the token grid), got {ndim!r}")
    block_size = as_int("block_size", block_size, "a power of two")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size!r}")
    bits = block_size.bit_length() - 1
    exp = [0] * ndim
    for i in range(bits):
        exp[ndim - 1 - i % ndim] += 1
    return tuple(2**e for e in exp)


def _sequence(layout: TokenOrder, text_before: int, n_image: int, block_size: int) -> Sequence:
    keep = layout.keep_blocks(block_size) if layout.num_text_tokens else None
    return Sequence(layout, layout.num_text_tokens, text_before, text_before + n_image, keep)


def build_layouts(grid: tuple[int, ...], text_len: int, text: str, tile: tuple[int, ...], block_size: int) -> Layouts:
    """Layouts of one grid. The hooks move only image tokens (text stays where the model puts it),
    so the joint layout uses the "compact_inplace" order: text in place, full tiles on block
    boundaries of the joint sequence. The image stream's layout is the same order offset by the
    text before it, so its permutation is exactly the image part of the joint one; the image-only
    sequence (SD3.5's attn2, text after: offset 0) counts blocks from its own first token."""
    if text not in ("before", "after", "none"):
        raise ValueError(f"text must be 'before', 'after' or 'none' (where the model puts its text tokens), "
                         f"got {text!r}")
    text_len = as_int("text_len", text_len, "an int >= 0")  # numpy ints too
    if text_len < 0:
        raise ValueError(f"text_len must be an int >= 0, got {text_len!r}")
    if text == "none" and text_len:
        raise ValueError(f"text_len must be 0 when text='none' (no text tokens), got {text_len}")
    block_size = as_int("block_size", block_size, "an int >= 1")
    if block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    before = text_len if text == "before" else 0
    after = text_len if text == "after" else 0
    image = make_layout(grid, tile=tile, order="compact_inplace", offset=before)
    joint = make_layout(grid, tile=tile, text_before=before, text_after=after, order="compact_inplace")
    n = image.num_tokens
    return Layouts(image, _sequence(joint, before, n, block_size), _sequence(image, 0, n, block_size))


# --- the ops a forward runs -------------------------------------------------------------------
def begin_forward(state: PisaState, timestep: Tensor, shape: list[int], grid_ids: Tensor | None) -> Run:
    """Open the :class:`Run` of one forward call: its grid (from ``shape`` or ``grid_ids``), layouts
    and denoising step (from ``timestep``, one host read). ``shape`` is
    ``[text_len, image_tokens, *grid]``."""
    text_len, n_image, *grid = (int(x) for x in shape)
    if not grid:
        grid = state.adapter.read_grid(grid_ids, state.read_cache)
    grid = tuple(grid)
    if math.prod(grid) != n_image:
        raise ValueError(f"hidden_states has {n_image} image tokens but the grid read from the call is {grid}")
    layouts = state.layouts.get((grid, text_len))
    if layouts is None:
        layouts = build_layouts(grid, text_len, state.adapter.text, state.config.tile, state.config.block_size)
        state.layouts[(grid, text_len)] = layouts
    check_no_tensor_parallel(state.transformer)  # enabled after apply_pisa
    check_token_split(state.transformer, layouts.joint)  # context parallelism: before diffusers shards tokens
    state.check_processors()
    t = timestep_value(timestep)
    close_run(state)  # left open by a compiled forward that raised (an eager one closes it on exit)
    step = state.tracker.observe(t)
    state.catch_up()  # the first call of a new generation starts it
    run = Run(state, step, CallInfo(grid, text_len, t), layouts)
    open_run(run)
    return run


@torch.library.custom_op("pisa_attn::diffusers_begin_forward", mutates_args=())
def _begin_op(
    handle: int, x: Tensor, timestep: Tensor, shape: list[int], grid_ids: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(perm, inv_perm) of the image tokens on ``x``'s device, after :func:`begin_forward`."""
    image = begin_forward(state_of(handle), timestep, shape, grid_ids).layouts.image
    # Copies: the cached permutations must not become buffers a compiled graph may reuse.
    return image.perm_on(x.device).clone(), image.perm_on(x.device, inverse=True).clone()


@_begin_op.register_fake
def _(handle, x, timestep, shape, grid_ids):
    n = shape[1]
    return x.new_empty(n, dtype=torch.long), x.new_empty(n, dtype=torch.long)


@torch.library.custom_op("pisa_attn::diffusers_end_forward", mutates_args=())
def _end_op(handle: int, x: Tensor, inv_perm: Tensor) -> Tensor:
    """``x`` ([B, L, C] tiled tokens) in original order; closes the forward's run."""
    out = x.index_select(1, inv_perm)
    close_run(state_of(handle))
    return out


@_end_op.register_fake
def _(handle, x, inv_perm):
    return x.new_empty(x.shape)


# --- hooks -------------------------------------------------------------------------------------
def _tiling(state: PisaState) -> tuple[Tensor, Tensor] | None:
    """(perm, inv_perm) of the forward in progress, unless tokens stay in model order (context
    parallelism: attention tiles per call)."""
    if state.tiling is None or tokens_stay_in_model_order(state.transformer):
        return None
    return state.tiling


def _index_on(perm: Tensor, x: Tensor) -> Tensor:
    """``perm`` on ``x``'s device: the permutation is made on the hidden states' device, and rotary
    embeddings or other token inputs may live on another (index_select needs one device)."""
    return perm if perm.device == x.device else perm.to(x.device)


def _tile_token_input(perm: Tensor, x):
    n = perm.shape[0]
    if isinstance(x, Tensor):
        return x.index_select(1, _index_on(perm, x)) if x.dim() >= 2 and x.shape[1] == n else x
    if isinstance(x, (list, tuple)):
        return type(x)(_tile_token_input(perm, t) for t in x)
    return x


def _pre_hook(state: PisaState, names: tuple[str, ...]):
    # The transformer's own hooks are partials of module functions, not closures: pickling the
    # model reaches the state through them and gets its clear refusal (PisaState.__reduce_ex__).
    return functools.partial(_begin_forward_hook, state, names)


def _begin_forward_hook(state: PisaState, names: tuple[str, ...], module, args, kwargs):
    adapter = state.adapter
    arguments = dict(zip(names, args))
    arguments.update(kwargs)
    grid, text_len, n_image = adapter.read_shape(module, arguments)
    ids = arguments.get(adapter.grid_input) if grid is None else None
    if grid is None and ids is None:
        raise ValueError(f"{type(module).__name__} needs {adapter.grid_input!r} to know its token grid")
    t = arguments.get("timestep")
    t = t.detach() if isinstance(t, Tensor) else torch.tensor(float(t))
    x = arguments["hidden_states"].detach()
    shape = [text_len, n_image, *(grid or ())]
    state.tiling = torch.ops.pisa_attn.diffusers_begin_forward(state.handle, x, t, shape, ids)
    tiling = _tiling(state)
    if tiling is None:
        return None
    changed = False
    for name in adapter.token_inputs:
        if arguments.get(name) is not None:
            new = _tile_token_input(tiling[0], arguments[name])
            changed |= new is not arguments[name]
            arguments[name] = new
    if not changed:
        return None
    n = len(args)
    return tuple(arguments[k] for k in names[:n]), {k: arguments[k] for k in kwargs}


def _post_hook(state: PisaState):
    return functools.partial(_end_forward_hook, state)


def _end_forward_hook(state: PisaState, module, args, output):
    # Also called when the forward raised: close a run the end op did not (eagerly only: a
    # compiled forward closes its run in the graph).
    state.tiling = None
    if not torch.compiler.is_compiling():
        close_run(state)
    return None


def _token_hook(state: PisaState, kind: str):
    def hook(module, args, out):
        tiling = _tiling(state)
        if tiling is None:
            return None
        perm = _index_on(tiling[0], out)
        if kind == "tokens":
            return out.index_select(1, perm)
        # Patch-embedding conv output [B, C, *grid]: flatten(2) is the raster token order.
        tiled = out.flatten(2).index_select(2, perm)
        return tiled.reshape(*out.shape[:2], *([1] * (out.dim() - 3)), tiled.shape[-1])

    return hook


def _rope_hook(state: PisaState, dim: int, text_before: bool):
    def tile(perm: Tensor, x: Tensor) -> Tensor:
        perm = _index_on(perm, x)
        if not text_before:
            return x.index_select(dim, perm)
        t = x.shape[dim] - perm.shape[0]
        text, image = x.narrow(dim, 0, t), x.narrow(dim, t, perm.shape[0])
        return torch.cat([text, image.index_select(dim, perm)], dim=dim)

    def hook(module, args, out):
        tiling = _tiling(state)
        if tiling is None:
            return None
        if isinstance(out, Tensor):
            return tile(tiling[0], out)
        return type(out)(tile(tiling[0], x) for x in out)

    return hook


def _untile_hook(state: PisaState):
    def hook(module, args, out):
        tiling = _tiling(state)
        if tiling is None:
            return None
        return torch.ops.pisa_attn.diffusers_end_forward(state.handle, out, tiling[1])

    return hook


HOOK_NAME = "pisa_tiling"


@functools.cache
def _output_hook_class():
    from diffusers.hooks import ModelHook  # here: the package imports without diffusers

    class OutputHook(ModelHook):
        """Replaces a module's output by ``fn(module, None, output)`` unless that is None."""

        def __init__(self, fn) -> None:
            super().__init__()
            self.fn = fn  # None: a pass-through (left so by an undo under another wrapper)
            self.installed_forward = None  # the forward the registry installed for this hook
            self.had = {}  # which of _diffusers_hook / forward the module had before it

        def post_forward(self, module, output):
            out = None if self.fn is None else self.fn(module, None, output)
            return output if out is None else out

    return OutputHook


def _add_output_hook(state: PisaState, module, fn) -> None:
    """Register ``fn`` as the :data:`HOOK_NAME` hook of ``module``'s diffusers ``HookRegistry``;
    its undo leaves the module as it was (no registry or ``forward`` attribute it did not have).

    When something outside the registry wrapped ``module.forward`` after this hook (accelerate's
    CPU offload does), removing the hook would put back the forward under that wrapper and drop
    it; the undo then leaves the hook in place as a pass-through (``fn = None``), which a later
    apply takes up again."""
    from diffusers.hooks import HookRegistry

    had = {k: k in module.__dict__ for k in ("_diffusers_hook", "forward")}
    registry = HookRegistry.check_if_exists_or_initialize(module)
    hook = registry.get_hook(HOOK_NAME)
    if isinstance(hook, _output_hook_class()) and hook.fn is None:  # left dormant by an earlier undo
        hook.fn = fn
        had = hook.had  # what the module had before the hook was first registered
    else:
        hook = _output_hook_class()(fn)
        registry.register_hook(hook, HOOK_NAME)
        hook.installed_forward = module.__dict__.get("forward")
        hook.had = had

    def undo() -> None:
        wrapped = registry._hook_order[-1:] == [HOOK_NAME] and module.__dict__.get("forward") is not \
            hook.installed_forward
        if wrapped:
            hook.fn = None
            return
        registry.remove_hook(HOOK_NAME, recurse=False)
        if not registry.hooks:  # HookRegistry keeps both after its last hook goes
            for key, was in had.items():
                if not was:
                    module.__dict__.pop(key, None)

    state.restore.append(undo)


def install(state: PisaState) -> None:
    """Register the boundary hooks of ``state.adapter`` on ``state.transformer`` (each appends its
    undo to ``state.restore``)."""
    tr, ad = state.transformer, state.adapter
    names = tuple(inspect.signature(tr.forward).parameters)
    pre = tr.register_forward_pre_hook(_pre_hook(state, names), with_kwargs=True)
    state.restore.append(pre.remove)
    post = tr.register_forward_hook(_post_hook(state), always_call=True)
    state.restore.append(post.remove)
    _add_output_hook(state, tr.get_submodule(ad.token_module), _token_hook(state, ad.token_output))
    if ad.rope_module is not None:
        _add_output_hook(state, tr.get_submodule(ad.rope_module), _rope_hook(state, ad.rope_dim, ad.rope_text_before))
    _add_output_hook(state, tr.get_submodule(ad.untile_module), _untile_hook(state))
