"""pisa-attn: Piecewise Sparse Attention (PISA) for diffusion transformers.

* :func:`pisa_attention` ``(q, k, v, density=..., ...)``: one call, ``[B, H, L, D]`` or ``[B, L, H, D]``.
* :class:`PisaSettings`: every setting of a call in one frozen, validated, hashable object.
* :func:`plan` ``(q, k, settings) -> PisaPlan`` and :func:`run` ``(plan, q, k, v, out=...)``: plan a
  shape once (backend, block counts, a workspace), then run it with no allocation but the output.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the submodule that defines it. Loaded on first use, so that importing the package
# (the ``pisa-attn`` command's ``--version`` and ``--help``) does not import torch.
_EXPORTS = {"pisa_attention": "attention", "PisaPlan": "attention", "plan": "attention", "run": "attention",
            "make_plan": "attention", "PisaSettings": "settings"}
__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from .attention import PisaPlan, make_plan, pisa_attention, plan, run
    from .settings import PisaSettings


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
