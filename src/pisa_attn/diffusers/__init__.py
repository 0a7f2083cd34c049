"""PISA for diffusers pipelines: ``apply_pisa(pipe)`` makes FLUX.1, SD3/3.5, Wan2.1 and
HunyuanVideo run their self-attention on PISA with the paper's warm-up policy.

It works through diffusers' public entry points (attention processors set per module, hooks on
the transformer) and changes nothing in diffusers itself; importing it changes nothing at all.
diffusers' attention dispatcher has no ``"pisa"`` backend (its backend names are a closed enum):
:func:`apply_pisa` is the entry point.
"""

from __future__ import annotations

from . import hooks
from .apply import alpha_table, apply_pisa, pisa_state, remove_pisa, stats
from .backend import TESTED_DIFFUSERS, check_diffusers
from .calibrate import CalibrationConfig
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
    "check_diffusers",
    "TESTED_DIFFUSERS",
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
