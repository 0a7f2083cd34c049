"""How the benchmark switches a diffusers transformer between its variants: a dense diffusers
backend, PISA applied, or the managed self-attention replaced by an opaque no-attention op (the
forward's cost without attention: each managed module's processor is swapped, through diffusers'
public ``set_processor``, for the family's PISA processor with an opaque op as its attention)."""

from __future__ import annotations

import contextlib
import fnmatch
import logging

import torch

from .. import dit_cases as dc


class QuietBackendWarning(logging.Filter):
    """Drops diffusers' warning on every ``set_attention_backend`` call (one per forward here)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Attention backends are an experimental feature" not in record.getMessage()


_NO_ATTENTION = None


def no_attention_op():
    """``torch.ops.pisa_bench.no_attention`` (registered once): an opaque op standing in for
    attention (q, k, v are still computed; the uninitialised result costs nothing)."""
    global _NO_ATTENTION
    if _NO_ATTENTION is None:

        @torch.library.custom_op("pisa_bench::no_attention", mutates_args=())
        def no_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            b, lq, h, _ = query.shape
            return query.new_empty(b, lq, h, value.shape[-1])

        @no_attention.register_fake
        def _(query, key, value):
            b, lq, h, _ = query.shape
            return query.new_empty(b, lq, h, value.shape[-1])

        _NO_ATTENTION = torch.ops.pisa_bench.no_attention
    return _NO_ATTENTION


def family_adapter_of(model):
    import pisa_attn.diffusers as pd

    return pd.adapter_for(model)


def managed_modules(model) -> list:
    """The self-attention modules PISA manages in ``model`` (its adapter's patterns)."""
    patterns = family_adapter_of(model).attention
    return [m for name, m in model.named_modules() if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


@contextlib.contextmanager
def routed(model):
    """The managed self-attention on the no-attention op, put back on exit. PISA's processors get
    the op as their attention; the model's own processors are swapped (``set_processor``) for the
    family's PISA processor with the op as its attention: the same projections, no attention."""
    from pisa_attn.diffusers.processors import PROCESSORS, PisaProcessor

    op = no_attention_op()
    cls = PROCESSORS[family_adapter_of(model).name]

    def attention(q, k, v, mask):
        return op(q, k, v).flatten(2, 3)

    patched, swapped = [], []
    for module in managed_modules(model):
        proc = module.processor
        if isinstance(proc, PisaProcessor):
            proc.attention = attention
            patched.append(proc)
        else:
            stand_in = cls(proc, handle=0, layer=-1)
            stand_in.attention = attention
            # no PISA state owns handle 0: without this the processor would count itself removed
            # and run the model's own (dense) processor eagerly
            stand_in.orphaned = lambda: False
            module.set_processor(stand_in)
            swapped.append((module, proc))
    try:
        yield
    finally:
        for p in patched:
            p.__dict__.pop("attention", None)
        for module, proc in swapped:
            module.set_processor(proc)


@contextlib.contextmanager
def dense_backend(model, name: str):
    """Every attention module of ``model`` on the diffusers backend ``name``."""
    from diffusers.models import attention_dispatch as ad

    model.set_attention_backend(name)
    try:
        yield
    finally:
        model.reset_attention_backend()
        ad._AttentionBackendRegistry.set_active_backend(ad.AttentionBackendName.NATIVE)


def pisa_settings(case: dc.Case, args) -> dict:
    return dict(
        density=case.density, mode=args.mode, dense_layers=0, dense_steps=0, block_size=args.block_size,
        # --tiny defaults to 0: its short sequences would otherwise all stay dense
        min_kv_len=(0 if args.tiny else None) if args.min_kv_len is None else args.min_kv_len,
        precision=args.precision,
    )  # fmt: skip


@contextlib.contextmanager
def pisa_applied(model, case: dc.Case, args):
    import pisa_attn.diffusers as pd

    kw = pisa_settings(case, args)
    if kw["min_kv_len"] is None:
        kw.pop("min_kv_len")  # the library default
    pd.apply_pisa(model, **kw)
    try:
        yield pd.pisa_state(model)
    finally:
        pd.remove_pisa(model)


def family_adapter(family: str):
    import pisa_attn.diffusers as pd

    return next(a for a in pd.ADAPTERS if a.name == family)


def sequence(case: dc.Case, block_size: int):
    import pisa_attn.diffusers as pd

    adapter = family_adapter(case.family)
    tile = pd.default_tile(len(case.grid), block_size)
    return pd.build_layouts(case.grid, case.joint_text, adapter.text, tile, block_size)


@contextlib.contextmanager
def stacked(*cms):
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(cm) for cm in cms]
