"""The method's vocabulary: modes, block counts, the density -> k rule and checks of the settings.

A leaf module (torch and the standard library only): the API, the backends, the integrations and
the tools all take these names from here.

* Key and query blocks hold ``block_size`` tokens; the last block of a sequence may hold fewer.
* ``k = max(1, round(density · N))`` exact key blocks per query block, ``N`` the number of key
  blocks, the rounding half up (``density · N = 2.5`` gives 3), and never more than ``N``.
* Selection is per query block of ``query_block`` tokens (default ``block_size``, the paper's; a
  multiple ``m · block_size``, ``m`` in :data:`QUERY_BLOCK_FACTORS`, pools the query means of ``m``
  consecutive blocks and gives them one shared set of exact key blocks, as SpargeAttn's 128-row
  query blocks do): fewer distinct selections, shared K/V loads, a coarser approximation.
* GQA: query head ``h`` reads key/value head ``h // (H // Hk)``.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

FLOAT32_MAX = torch.finfo(torch.float32).max  # the kernels' arithmetic

MODES = ("hybrid", "zeroth", "first", "drop")
"""``hybrid``: exact + block-wise 0th order + one global 1st-order term with H̄ (the paper's method);
``zeroth``: no 1st-order term; ``first``: exact block-wise 1st order (the accuracy bound);
``drop``: keep-or-drop block sparse (no tail)."""

FIRST_ORDER_MODES = ("hybrid", "first")
"""The modes with a first-order tail term, the term the weight ``alpha`` multiplies."""

DEFAULT_COVARIANCE_AWARE = True
"""Covariance-aware selection (paper eq. 9) unless told otherwise. It computes exactly the blocks
whose within-block covariance ``H_j`` the centroid term cannot represent (sink-like blocks), which
also makes the tail error less biased: held out at 12.5% it beat pooled top-k on pretrained DINOv2
(rel-L1 0.177 vs 0.182 at the default weight, signed bias 0.104 vs 0.108) and on DiT-like heads
(equal on image + text), and on a diffusion UNet end to end it took the output from 36.9 to 51.1 dB
PSNR against dense (``benchmarks/results/calibration_bias_*.json``, ``notes/tail-weight-calibration.md``).
It costs one more pass over the keys in prepare."""

DEFAULT_ALPHA = 0.75
"""Weight of the first-order tail term when none is given (``1.0`` is the paper). On real
attention (pretrained DINOv2, 9 inputs x 12 layers) the full Taylor step overshoots; 0.75 beats 1.0
on every input at 5%, 12.5% and 25% density, and on DiT-like synthetic heads it stays within 0.2%
of 1.0."""

ALPHA_LIMIT = 1e3
"""The largest first-order weight a call takes (either sign). A weight is a fraction of the Taylor
term: calibration clamps to ``[0, 1]``, unclamped per-head fits on real attention stayed below 12;
a weight like 1e30 gives a finite but meaningless output that overflows the next layer."""


def check_alpha_values(values, alpha) -> None:
    """ValueError naming ``alpha`` unless every one of ``values`` is finite and within
    :data:`ALPHA_LIMIT`."""
    if not all(x == x and abs(x) <= ALPHA_LIMIT for x in values):
        raise ValueError(f"alpha must be finite and within ±{ALPHA_LIMIT:g} (a weight of the first-order "
                         f"term; calibrated weights lie in [0, 1]), got {alpha!r}")


HBAR_SCOPES = ("global", "row")
"""Which blocks the hybrid term's mean ``H̄`` describes: ``global`` one ``H̄`` per head for every row
(the paper's eq. 7, the kernels'), ``row`` the mean over each row's own tail (reference only)."""

PRECISIONS = ("input", "fp8", "int8-fp8", "int8-int8", "int8")
"""Precision of the exact blocks' products: ``input`` the input dtype (float16/bfloat16 tensor
cores, the default); the others quantise them as :data:`PRODUCT_FORMATS` lists (Hopper kernel
only; smoothed keys, one scale per key block and per query row; the tail stays in the input
precision; math in :mod:`pisa_attn.ops.quant`)."""

PRODUCT_FORMATS = {"fp8": ("e4m3", "e4m3"), "int8-fp8": ("int8", "e4m3"), "int8-int8": ("int8", "int8"),
                   "int8": ("int8", "input")}
"""Low precisions: the formats of the exact blocks' ``(Q·Kᵀ, P·V)``: ``e4m3`` FP8 (power-of-two
scales), ``int8`` (``amax/127`` scales, int32 accumulation; in ``P·V`` the probabilities as
unsigned 8-bit codes ``round(255·p)``), ``input`` the input dtype."""

COV_EPS = 1e-6
"""Covariance-aware selection adds ``log(||H_j − H̄||_F + COV_EPS)`` to the pooled scores (eq. 9).
The paper's ``M_j`` is the spectral norm ``||H_j − H̄||_2`` (its error bound's); the Frobenius norm
bounds it from above and costs one pass over each block's product instead of a decomposition."""

MIN_BLOCK_SIZE = 16
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # the head dims every backend takes (a kernel may take fewer)
QUERY_BLOCK_FACTORS = (1, 2, 4)


def num_blocks(length: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens covering ``length`` tokens (the last one may be ragged)."""
    return (length + block_size - 1) // block_size  # not -(-a // b): a traced SymInt length needs this form


def num_selected(density: float, n_kv_blocks: int) -> int:
    """Exact blocks per query block: ``max(1, density · N)`` rounded half up, at most ``N``.

    The product is rounded as the decimal density reads (0.29 · 50 = 14.5 gives 15, though the
    float product is 14.4999...): a margin of 1e-9 far above the product's rounding error and far
    below any density's step. A numpy float narrower than 64 bits is read as its decimal
    (:func:`decimal_value`): its own rounding error is larger than the margin."""
    return max(1, min(n_kv_blocks, int(math.floor(decimal_value(density) * n_kv_blocks + 0.5 + 1e-9))))


def decimal_value(x):
    """``x``, or for a numpy float narrower than 64 bits the decimal it prints as: ``np.float32(0.35)``
    is 0.35, not 0.3499999940…, which would select one block fewer wherever ``0.35·N`` rounds at one
    half."""
    if type(x).__module__ == "numpy" and not isinstance(x, numbers.Integral) and getattr(x, "itemsize", 8) < 8:
        return float(str(x))
    return x


def selection_width(n_kv_blocks: int, n_select: int, n_keep_max: int = 0) -> int:
    """Static width of a selection's index list: top-k plus at most ``n_keep_max`` kept blocks."""
    return max(1, min(n_kv_blocks, n_select + n_keep_max))


def block_counts(length: int, block_size: int, device=None, dtype=torch.float32) -> Tensor:
    """Tokens per block ``n_j``: ``[N]``, ``block_size`` everywhere but a ragged last block."""
    n = num_blocks(length, block_size)
    counts = torch.full((n,), float(block_size), dtype=dtype, device=device)
    if n:  # fill_, not item assignment (a host copy): CUDA-graph capturable
        counts[-1:].fill_(length - (n - 1) * block_size)
    return counts


def expand_kv_heads(x: Tensor, heads: int) -> Tensor:
    """Repeat kv-head tensors (dim 1) to the query head count (GQA)."""
    hk = x.shape[1]
    if hk == heads:
        return x
    return x.repeat_interleave(heads // hk, dim=1)


# ---------------------------------------------------------------- checks of the settings
def check_mode(mode) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def is_numpy_bool(x) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_")


def _is_bool(x) -> bool:
    return isinstance(x, bool) or is_numpy_bool(x)


def is_int(x) -> bool:
    """A Python or numpy integer that is not a bool (numpy's bool is not Integral, but be explicit)."""
    return isinstance(x, numbers.Integral) and not _is_bool(x)


def check_density(density) -> None:
    # numbers.Real takes numpy scalars; comparing without float() takes any int (no OverflowError)
    if _is_bool(density) or not isinstance(density, numbers.Real):
        raise TypeError(f"density must be a float in (0, 1], got {type(density).__name__}")
    if not (0 < density <= 1):  # also rejects NaN
        raise ValueError(f"density must be in (0, 1], got {density}")


def check_block_size(block_size) -> None:
    ok = is_int(block_size)
    if not ok or block_size < MIN_BLOCK_SIZE or int(block_size) & (int(block_size) - 1):
        raise ValueError(f"block_size must be a power of two >= {MIN_BLOCK_SIZE}, got {block_size!r}")


def check_scale(scale) -> None:
    if scale is None:
        return
    ok = isinstance(scale, numbers.Real) and not _is_bool(scale)
    if ok:
        # The value PisaSettings stores (a narrow numpy float's decimal), as a Python float: a
        # numpy comparison would cast FLOAT32_MAX to float16 (an overflow warning).
        try:
            scale = float(decimal_value(scale))
        except OverflowError:
            ok = False
    # NaN fails the comparison; past float32's largest value the kernels' scale is inf (NaN outputs)
    if not ok or not 0 < scale <= FLOAT32_MAX:
        raise ValueError(f"scale must be None or a positive finite float (at most {FLOAT32_MAX:.4g}, float32's "
                         f"largest), got {scale!r}")


def query_block_factor(query_block, block_size: int) -> int:
    """``m = query_block / block_size`` (``None`` means ``block_size``, i.e. 1); ValueError unless
    ``m`` is one of :data:`QUERY_BLOCK_FACTORS`."""
    if query_block is None:
        return 1
    ok = is_int(query_block)  # numpy ints too
    if not ok or query_block % block_size or query_block // block_size not in QUERY_BLOCK_FACTORS:
        allowed = ", ".join(str(f * block_size) for f in QUERY_BLOCK_FACTORS)
        raise ValueError(f"query_block must be None or one of {allowed} (block_size times {QUERY_BLOCK_FACTORS}), "
                         f"got {query_block!r}")
    return int(query_block) // int(block_size)


def check_precision(precision) -> None:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def check_flag(name: str, value) -> None:
    """Flags are real booleans (numpy's too, as PisaSettings takes them): a truthy string such as
    ``"no"`` is an error, not ``True``."""
    if not _is_bool(value):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def check_settings(*, density, block_size, mode, covariance_aware=False, scale=None, query_block=None) -> None:
    """ValueError/TypeError naming the argument, for the settings every entry point shares."""
    check_density(density)
    check_block_size(block_size)
    query_block_factor(query_block, block_size)
    check_mode(mode)
    check_flag("covariance_aware", covariance_aware)
    check_scale(scale)
