"""Warm-up schedule: which attention calls run dense, and which denoising step a call belongs to.

The backend only asks :meth:`Schedule.dense_reason`; the transformer-level hook only asks
:meth:`StepTracker.observe`. Both are plain Python (no tensors), so they are trivially testable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..settings import as_int

# Below this many keys a sparse call costs more than dense attention: one FLUX.1 attention call
# (24 heads, 512 text tokens) on an H100 with the Hopper kernel ran at 0.12x / 0.39x / 1.07x /
# 1.64x of cuDNN at 1536 / 4608 / 9728 / 16896 keys (benchmarks/bench_e2e.py). So FLUX at 1024²
# (4608 keys) stays dense and at 2048² (16896) goes sparse; video DiTs (30K+ tokens) go sparse.
DEFAULT_MIN_KV_LEN = 9216


def _check_count(name: str, value) -> int:
    """``value`` as an int >= 0 (numpy integers too; not a bool); TypeError/ValueError naming ``name``."""
    value = as_int(name, value, "an int >= 0")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class Schedule:
    """Dense-or-sparse decision per managed self-attention call.

    dense_layers: the first ``dense_layers`` transformer blocks always run dense, every attention
                  layer in them (SD3.5's attn and attn2 of a block); blocks keep their index when
                  SD3's skip-layer guidance skips some.
    dense_steps:  the first ``dense_steps`` denoising steps run dense in every layer.
    min_kv_len:   calls with fewer keys run dense (too few tokens for sparsity to pay).
    """

    dense_layers: int = 0
    dense_steps: int = 0
    min_kv_len: int = DEFAULT_MIN_KV_LEN

    def __post_init__(self):
        for name in ("dense_layers", "dense_steps", "min_kv_len"):
            object.__setattr__(self, name, _check_count(name, getattr(self, name)))

    def dense_reason(self, layer: int, step: int, kv_len: int) -> str | None:
        """Why the call in transformer block ``layer`` at ``step`` with ``kv_len`` keys runs dense,
        or None (sparse)."""
        if step < self.dense_steps:
            return "warmup_step"
        if layer < self.dense_layers:
            return "warmup_layer"
        if kv_len < self.min_kv_len:
            return "few_tokens"
        return None


class StepTracker:
    """Maps the ``timestep`` of each transformer call to a 0-based denoising step.

    Calls sharing a timestep belong to one step (Wan's separate cond/uncond calls, FLUX/Hunyuan
    true-CFG); SD3's batched CFG is one call. A timestep larger than the previous one means a new
    generation (diffusion samplers only ever lower the noise level); :attr:`generation` counts
    them, so transformers sharing a tracker (Wan2.2's two experts) each see a new one, and
    :meth:`reset` starts one explicitly. :meth:`stepped` (the pipeline's ``scheduler.step`` ran)
    makes the next call a new step even at an equal timestep: FLUX passes timesteps in the latents'
    dtype, and in bfloat16 neighbouring steps near 1000 round to one value.
    """

    def __init__(self) -> None:
        self.generation = -1
        self.reset()

    def reset(self) -> None:
        self.step = -1
        self._last: float | None = None
        self._stepped = False

    def stepped(self) -> None:
        self._stepped = True

    def observe(self, t: float) -> int:
        if not isinstance(t, float) or math.isnan(t):
            raise ValueError(f"timestep must be a float, got {t!r}")
        if self._last is None or t > self._last:
            self.step = 0
            self.generation += 1
        elif t < self._last or self._stepped:
            self.step += 1
        self._last, self._stepped = t, False
        return self.step
