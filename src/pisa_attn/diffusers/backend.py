"""The ``"pisa"`` attention backend of diffusers' attention dispatcher.

diffusers (0.42) has no public API to add a backend, so :func:`register` extends its
``AttentionBackendName`` enum and ``_AttentionBackendRegistry`` behind a version guard. The
registered function validates the dispatcher's arguments and hands q/k/v (``[B, L, H, D]``) to
:func:`.calls.attend` (one process) or :func:`.parallel.parallel_attention` (diffusers context
parallelism).

Under ``torch.compile`` the call goes through the opaque custom op ``pisa_attn::diffusers_attention``
so the per-step dense/sparse switch never enters a graph guard (no recompilation per step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .calls import attend
from .parallel import parallel_attention

BACKEND_NAME = "pisa"
TESTED_DIFFUSERS = ((0, 42),)  # (major, minor) releases the registration is tested against


# --- registration ------------------------------------------------------------------------------
def _diffusers_version() -> tuple[int, int]:
    try:
        import diffusers
    except ImportError as e:
        raise RuntimeError("pisa_attn.diffusers needs diffusers: pip install 'pisa-attn[diffusers]'") from e
    parts = diffusers.__version__.split(".")
    return int(parts[0]), int(parts[1])


def check_diffusers() -> None:
    """RuntimeError unless the installed diffusers is a tested release (the registry is private)."""
    ver = _diffusers_version()
    if ver not in TESTED_DIFFUSERS:
        import diffusers

        tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_DIFFUSERS)
        raise RuntimeError(
            f"pisa_attn.diffusers registers its attention backend through diffusers' private dispatcher "
            f"registry, tested with diffusers {tested}; found diffusers {diffusers.__version__}. "
            f"Install a tested version: pip install 'diffusers>=0.42,<0.43'"
        )


def _enum_member(enum_cls, name: str, value: str):
    """Add a member to a ``str`` Enum after class creation (no public API for it)."""
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


def register():
    """Register the ``"pisa"`` backend (idempotent); returns its ``AttentionBackendName`` member."""
    check_diffusers()
    from diffusers.models import attention_dispatch as ad

    from .processors import route_joint_processor

    member = _enum_member(ad.AttentionBackendName, "PISA", BACKEND_NAME)
    if ad._AttentionBackendRegistry._backends.get(member) is not dispatcher_attention:
        # supports_context_parallel: .parallel runs Ulysses/ring itself.
        ad._AttentionBackendRegistry.register(member, constraints=[], supports_context_parallel=True)(
            dispatcher_attention
        )
    route_joint_processor(member)  # SD3's processor calls SDPA itself unless routed
    return member


def dispatcher_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
) -> Tensor:
    """The function diffusers' dispatcher calls for ``backend="pisa"`` (q/k/v ``[B, L, H, D]``)."""
    if dropout_p:
        raise ValueError(f"the pisa attention backend is inference-only: dropout_p must be 0, got {dropout_p}")
    if is_causal:
        raise ValueError("the pisa attention backend does not support is_causal=True (DiT attention is bidirectional)")
    if return_lse:
        raise ValueError("the pisa attention backend does not return the LSE through the dispatcher (return_lse=True)")
    if _parallel_config is not None:  # context parallelism: all of it lives in .parallel
        return parallel_attention(query, key, value, attn_mask, scale, enable_gqa, _parallel_config)
    if torch.compiler.is_compiling():
        return torch.ops.pisa_attn.diffusers_attention(query, key, value, attn_mask, scale, enable_gqa)
    return attend(query, key, value, attn_mask, scale, enable_gqa)


# The op's body reads Python state (run, step, layer); being opaque to Dynamo keeps that state out
# of graph guards. Its output is always a contiguous [B, L, H, D] tensor, as the fake kernel declares
# (the layout the processors' flatten(2, 3) reads without a copy).
@torch.library.custom_op("pisa_attn::diffusers_attention", mutates_args=())
def _attention_op(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, scale: float | None, enable_gqa: bool
) -> Tensor:
    return attend(query, key, value, attn_mask, scale, enable_gqa).contiguous()


@_attention_op.register_fake
def _(query, key, value, attn_mask, scale, enable_gqa):
    b, lq, h, _ = query.shape
    return query.new_empty(b, lq, h, value.shape[-1])
