"""How the benchmark switches a diffusers transformer between its variants: a dense diffusers
backend, PISA applied, or the managed self-attention replaced by an opaque no-attention op (the
forward's cost without attention). The no-attention op is registered as a diffusers backend when a
stage first needs it, in the benchmark's process only; importing this module changes nothing."""

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


_NULL = None


def null_backend():
    """The diffusers backend member of the no-attention op (registered once)."""
    global _NULL
    if _NULL is not None:
        return _NULL
    from diffusers.models import attention_dispatch as ad

    @torch.library.custom_op("pisa_bench::no_attention", mutates_args=())
    def no_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # Opaque to the compiler: q, k, v are still computed; the uninitialised result costs nothing.
        b, lq, h, _ = query.shape
        return query.new_empty(b, lq, h, value.shape[-1])

    @no_attention.register_fake
    def _(query, key, value):
        b, lq, h, _ = query.shape
        return query.new_empty(b, lq, h, value.shape[-1])

    def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 _parallel_config=None):  # fmt: skip
        return torch.ops.pisa_bench.no_attention(query, key, value)

    member = _enum_member(ad.AttentionBackendName, "PISA_BENCH_NO_ATTENTION", "pisa_bench_no_attention")
    ad._AttentionBackendRegistry.register(member, constraints=[])(dispatch)
    _NULL = member
    return member


def _enum_member(enum_cls, name: str, value: str):
    """Add a member to a ``str`` Enum after class creation: the benchmark's no-attention backend
    (a measuring device in the benchmark's process only, made when a stage first needs it; the
    library registers nothing)."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)  # before the map: EnumType forbids reassigning members
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def managed_processors(model) -> list:
    """The attention processors of the modules PISA manages (the adapter's self-attention)."""
    import pisa_attn.diffusers as pd

    adapter = pd.adapter_for(model)
    procs = {}
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in adapter.attention):
            procs[id(module.processor)] = module.processor
    return list(procs.values())


@contextlib.contextmanager
def routed(model, member):
    """The managed self-attention processors on ``member``, put back on exit (PISA's processors,
    which compute their own attention, on the no-attention op)."""
    from pisa_attn.diffusers.processors import PisaProcessor

    missing = object()
    procs = managed_processors(model)
    saved = [(p, p.__dict__.get("_attention_backend", missing)) for p in procs]
    for p in procs:
        p._attention_backend = member
        if isinstance(p, PisaProcessor):
            p.attention = lambda q, k, v, mask: torch.ops.pisa_bench.no_attention(q, k, v).flatten(2, 3)
    try:
        yield
    finally:
        for p, old in saved:
            p.__dict__.pop("attention", None)
            if old is missing:
                p.__dict__.pop("_attention_backend", None)
            else:
                p._attention_backend = old


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
        min_kv_len=0 if args.tiny else args.min_kv_len,
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
