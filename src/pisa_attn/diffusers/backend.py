"""Where a managed layer's attention call goes, and the diffusers versions this is tested with.

The processors (:mod:`.processors`) call :func:`attention` with their layer index; it runs the
call on one process (:func:`.calls.attend`) or under diffusers context parallelism
(:func:`.parallel.parallel_attention`). Under ``torch.compile`` the one-process call goes through
the opaque custom op ``pisa_attn::diffusers_attention``, so the per-step dense/sparse switch never
enters a graph guard (no recompilation per step).

PISA registers nothing in diffusers' attention dispatcher: its backend names are a closed enum, so
``set_attention_backend("pisa")`` is not an entry point; :func:`apply_pisa` is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .calls import attend
from .parallel import context_parallel_config, parallel_attention
from .state import state_of

# (major, minor) releases tested: the processors mirror these releases' attention processors, and
# context parallelism reads the process groups of their ContextParallelConfig.
TESTED_DIFFUSERS = ((0, 42),)


def _diffusers_version() -> tuple[int, int]:
    try:
        import diffusers
    except ImportError as e:
        raise RuntimeError("pisa_attn.diffusers needs diffusers: pip install 'pisa-attn[diffusers]'") from e
    parts = diffusers.__version__.split(".")
    return int(parts[0]), int(parts[1])


def check_diffusers() -> None:
    """RuntimeError unless the installed diffusers is a tested release."""
    ver = _diffusers_version()
    if ver not in TESTED_DIFFUSERS:
        import diffusers

        tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_DIFFUSERS)
        raise RuntimeError(
            f"pisa_attn.diffusers is tested with diffusers {tested} (its processors mirror that release's attention "
            f"processors; context parallelism reads its process groups); found diffusers {diffusers.__version__}. "
            f"Install a tested version: pip install 'diffusers>=0.42,<0.43'"
        )


def attention(handle: int, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
              parallel_config=None) -> Tensor:
    """Managed layer ``layer`` of the transformer whose state is ``handle``: q/k/v ``[B, L, H, D]``
    -> ``[B, L, H, D]``."""
    if parallel_config is not None and context_parallel_config(parallel_config, config=True) is not None:
        return parallel_attention(state_of(handle), layer, q, k, v, mask, parallel_config)
    if torch.compiler.is_compiling():
        return torch.ops.pisa_attn.diffusers_attention(handle, layer, q, k, v, mask)
    return attend(state_of(handle), layer, q, k, v, mask)


# The op's body reads Python state (run, step); being opaque to Dynamo keeps that state out of
# graph guards. Its output is always a contiguous [B, L, H, D] tensor, as the fake kernel declares
# (the layout the processors' flatten(2, 3) reads without a copy).
@torch.library.custom_op("pisa_attn::diffusers_attention", mutates_args=())
def _attention_op(
    handle: int, layer: int, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None
) -> Tensor:
    return attend(state_of(handle), layer, query, key, value, attn_mask).contiguous()


@_attention_op.register_fake
def _(handle, layer, query, key, value, attn_mask):
    b, lq, h, _ = query.shape
    return query.new_empty(b, lq, h, value.shape[-1])
