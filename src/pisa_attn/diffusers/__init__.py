"""PISA for diffusers pipelines: ``apply_pisa(pipe)`` makes FLUX.1, SD3/3.5, Wan2.1 and
HunyuanVideo run their self-attention on PISA with the paper's warm-up policy.

Importing this package registers the ``"pisa"`` backend in diffusers' attention dispatcher (when a
tested diffusers is installed), so ``transformer.set_attention_backend("pisa")`` works too.
"""

from __future__ import annotations

import importlib.util
import warnings

from . import hooks
from .apply import alpha_table, apply_pisa, pisa_state, remove_pisa, stats
from .backend import BACKEND_NAME, check_diffusers, register
from .calibrate import CalibrationConfig
from .calls import configure
from .capture import capture_qkv
from .models import ADAPTERS, ModelAdapter, adapter_for
from .schedule import DEFAULT_MIN_KV_LEN, Schedule, StepTracker
from .state import PisaConfig, PisaState
from .telemetry import report
from .tiling import build_layouts, default_tile

__all__ = [
    "apply_pisa",
    "alpha_table",
    "CalibrationConfig",
    "capture_qkv",
    "report",
    "remove_pisa",
    "pisa_state",
    "stats",
    "register",
    "configure",
    "check_diffusers",
    "BACKEND_NAME",
    "ADAPTERS",
    "ModelAdapter",
    "adapter_for",
    "Schedule",
    "StepTracker",
    "PisaConfig",
    "PisaState",
    "build_layouts",
    "default_tile",
    "hooks",
    "DEFAULT_MIN_KV_LEN",
]

# Without diffusers this package still imports; apply_pisa/register then raise a clear error.
# An untested diffusers warns now and raises then.
if importlib.util.find_spec("diffusers") is not None:
    try:
        register()
    except RuntimeError as e:
        warnings.warn(str(e), RuntimeWarning, stacklevel=2)
