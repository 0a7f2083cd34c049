"""Small helpers shared by the Triton launchers (no kernels here)."""

from __future__ import annotations

import functools
import os

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# Rows a kernel addresses with int32 offsets from one int64 row base (a block of keys or queries):
# a token stride times this must stay below 2^31.
TILE_ROWS = 128


def check_token_strides(**views) -> None:
    """ValueError naming the tensor whose token stride (``[B, H, L, D]`` views: dim 2) is too large
    for the kernels' 32-bit in-tile offsets (far beyond any real layout: 2^24 elements per token)."""
    for name, x in views.items():
        if x is not None and x.shape[2] > 1 and x.stride(2) * TILE_ROWS >= 2**31:
            raise ValueError(f"{name} has a token stride of {x.stride(2)} elements, beyond the Triton kernels' "
                             f"32-bit offsets within a tile ({2**31 // TILE_ROWS}): pass {name}.contiguous()")


def rows_past_int32(*views) -> bool:
    """Whether a row index times the token stride of any ``[B, H, L, D]`` view passes 2^31."""
    return any(x.shape[2] > 1 and (x.shape[2] - 1) * x.stride(2) >= 2**31 for x in views)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def compile_sm90(fn, types: dict, constexprs: dict, *, aligned: bool = False, divisible: tuple = (), **options):
    """Compile the Triton kernel ``fn`` for sm_90 without a GPU (the CPU build tests read its PTX,
    SASS and spills): arguments in ``constexprs`` are those constants, those in ``types`` take that
    Triton type (``"*fp32"``, ``"fp32"``, ...), every other one is an ``i32``; ``aligned``: every
    pointer 16-byte aligned, as launches on fresh tensors specialise them; ``divisible``: integer
    arguments a launch sees as multiples of 16 (the strides of contiguous tensors), which it
    specialises alike (a stride of 1 is a constant: pass it in ``constexprs``). ``options``:
    Triton's (``num_warps``, ``num_stages``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if (aligned and sig[n].startswith("*")) or n in divisible} or None
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (a fixed small number under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def chunking(n_items: int, n_rows: int, device: torch.device, waves: int = 1) -> tuple[int, int]:
    """Split ``n_items`` per row into equal chunks so that ``n_rows * n_chunks`` programs fill at
    most ``waves`` waves of the GPU (at least one chunk per row): returns (items per chunk, chunks
    per row). One wave suits the kv-statistics kernel: one program per SM, and each program's
    D×D atomic add is a fixed cost, so fewer, longer programs win."""
    if n_items <= 0:  # nothing to split (an empty K/V shard): no chunk, so no program
        return 1, 0
    chunks = max(1, min(n_items, (waves * sm_count(device)) // max(1, n_rows)))
    per = -(-n_items // chunks)
    return per, -(-n_items // per)
