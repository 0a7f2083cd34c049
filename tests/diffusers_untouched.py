"""Test-only: what importing pisa_attn.diffusers, and applying and removing PISA on every tiny
family, changes in diffusers: its classes, enums, registries and pipeline methods, by identity.
Runs in a rank forked from :mod:`local_ranks`' server, where diffusers is loaded as diffusers made
it, so this module imports nothing of pisa_attn.diffusers until the first snapshot is taken."""

from __future__ import annotations

import enum
import importlib
import sys

import torch

MODULES = [
    "diffusers.models.attention_dispatch", "diffusers.models.attention_processor", "diffusers.models.attention",
    "diffusers.models.modeling_utils", "diffusers.models.embeddings", "diffusers.hooks.hooks",
    "diffusers.hooks.context_parallel", "diffusers.models.transformers.transformer_flux",
    "diffusers.models.transformers.transformer_sd3", "diffusers.models.transformers.transformer_wan",
    "diffusers.models.transformers.transformer_hunyuan_video", "diffusers.pipelines.pipeline_utils",
    "diffusers.pipelines.flux.pipeline_flux", "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3",
    "diffusers.pipelines.wan.pipeline_wan", "diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video",
]


def snap() -> dict:
    out = {}
    for name in MODULES:
        mod = importlib.import_module(name)
        out[name] = {k: id(v) for k, v in vars(mod).items()}
        for k, v in vars(mod).items():
            if isinstance(v, type) and v.__module__ == name:
                out[f"{name}.{k}"] = {a: id(b) for a, b in vars(v).items() if a != "_abc_impl"}
                if issubclass(v, enum.Enum):
                    out[f"{name}.{k}.members"] = {m: id(x) for m, x in v.__members__.items()}
                    out[f"{name}.{k}.values"] = sorted(map(str, v._value2member_map_))
    reg = importlib.import_module("diffusers.models.attention_dispatch")._AttentionBackendRegistry
    out["registry"] = {
        "backends": {str(k): id(f) for k, f in reg._backends.items()},
        "cp": sorted(reg._supports_context_parallel), "active": str(reg._active_backend),
    }
    return out


def changed_by_pisa(rank: int, world: int) -> dict:
    """``{"import": keys the import changed, "apply": keys still changed after apply + remove}``."""
    loaded = sorted(m for m in sys.modules if m == "pisa_attn.diffusers" or m.startswith("pisa_attn.diffusers."))
    if loaded:  # the snapshot below would not be diffusers' own
        raise RuntimeError(f"pisa_attn.diffusers was imported before the first snapshot: {loaded}")
    before = snap()
    import pisa_attn.diffusers as pd

    for sub in ("calibrate", "capture", "processors", "telemetry", "parallel"):
        importlib.import_module(f"pisa_attn.diffusers.{sub}")
    from diffusers_tiny import FAMILIES, prompt_kwargs, tiny_pipeline

    after_import = snap()
    for family in FAMILIES:
        pipe = tiny_pipeline(family)
        pipe.set_progress_bar_config(disable=True)
        pd.apply_pisa(pipe, density=0.5, block_size=16, min_kv_len=0, dense_layers=0, dense_steps=1, telemetry=True)
        with torch.no_grad():
            pipe(**prompt_kwargs(family), num_inference_steps=2)
        assert pd.stats(pipe.transformer)["sparse"] > 0
        pd.remove_pisa(pipe)
    after = snap()

    def diff(a, b):
        return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))

    return {"import": diff(before, after_import), "apply": diff(before, after)}
