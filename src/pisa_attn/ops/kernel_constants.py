"""Constants every kernel module shares (the Triton and the Hopper kernels read the same ones)."""

from __future__ import annotations

MODE_IDS = {"drop": 0, "zeroth": 1, "hybrid": 2}
"""The kernels' ``MODE`` constexpr per mode (``"first"`` has no kernel: it runs on the reference)."""

LOG2E = 1.4426950408889634
"""log2(e): kernels keep scores in base 2 (``exp2``), so the softmax scale is multiplied by it."""

LN2 = 0.6931471805599453
"""ln(2): turns a base-2 log-sum-exp back into the natural log callers get."""

MAX_GRID_YZ = 65535
"""CUDA's limit on a launch grid's second and third dimensions; the kernels put ``B·H`` there."""
