"""Paper-scale diffusers cases: which transformer, at which size, with which PISA settings, and
what the paper reports for it; plus random-weight models and forward inputs for them.

A case is one transformer config at one latent size. Latent sizes follow the pipelines: the Wan
and HunyuanVideo VAEs compress 4x in time ((frames - 1) / 4 + 1) and 8x in space, then the
transformers patchify 1x2x2; FLUX packs its 8x VAE latent 2x2, so its token grid is the image
size / 16; SD3 patchifies its 8x VAE latent 2x2 (also image size / 16). Text tokens are the pipelines' prompt
lengths (Wan and FLUX: 512 T5 tokens; SD3: 77 CLIP + 256 T5; Hunyuan: 256 LLaMA tokens, all valid here). Settings and schedules are the paper's (density from its
"sparsity", warm-up from appendix D, FLUX with covariance-aware selection as the adapter's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .model_configs import (
    FLUX_DEV, FLUX_TINY, HUNYUAN_TINY, HUNYUAN_VIDEO, SD3_TINY, SD35_LARGE, WAN_1_3B, WAN_14B, WAN_TINY,
)  # fmt: skip

FAMILIES = ("wan", "hunyuan", "flux", "sd3")
_CLASSES = {
    "wan": "WanTransformer3DModel", "hunyuan": "HunyuanVideoTransformer3DModel", "flux": "FluxTransformer2DModel",
    "sd3": "SD3Transformer2DModel",
}  # fmt: skip


@dataclass(frozen=True)
class Paper:
    """End-to-end numbers the paper reports for a model (its video and image tables: whole
    generations with text encoders and VAE, against its own dense baseline)."""

    speedup: float  # with its warm-up schedule
    speedup_no_warmup: float | None = None
    dense_s: float | None = None  # generation latency, dense
    pisa_s: float | None = None  # generation latency, PISA with warm-up
    setting: str = ""


@dataclass(frozen=True)
class Case:
    """One transformer config at one size, with the paper's PISA settings for it."""

    key: str
    title: str
    family: str  # "wan", "hunyuan", "flux" or "sd3"
    config: dict
    latent: tuple[int, ...]  # video: VAE latent (frames, height, width); flux: packed token grid (h, w);
    # sd3: VAE latent (height, width)
    text: int  # prompt tokens the transformer gets
    density: float
    dense_layers: int  # the paper's warm-up: first transformer blocks dense ...
    dense_steps: int  # ... and first denoising steps dense
    paper: Paper | None = None
    compile_fraction: float = 1.0  # share of the blocks the compiled stage builds by default
    text_valid: int | None = None  # valid prompt tokens (Hunyuan's mask); None: all

    @property
    def grid(self) -> tuple[int, ...]:
        """Token grid after patchification."""
        return token_grid(self.family, self.config, self.latent)

    @property
    def image_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def joint_text(self) -> int:
        """Text tokens inside the self-attention sequence (Wan's text is cross-attention only)."""
        return 0 if self.family == "wan" else self.text

    @property
    def heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def head_dim(self) -> int:
        return self.config["attention_head_dim"]

    @property
    def blocks(self) -> int:
        return self.config["num_layers"] + self.config.get("num_single_layers", 0)


def token_grid(family: str, config: dict, latent: tuple[int, ...]) -> tuple[int, ...]:
    if family == "wan":
        pt, ph, pw = config["patch_size"]
        return (latent[0] // pt, latent[1] // ph, latent[2] // pw)
    if family == "hunyuan":
        p, pt = config["patch_size"], config["patch_size_t"]
        return (latent[0] // pt, latent[1] // p, latent[2] // p)
    if family == "flux":
        return tuple(latent)
    if family == "sd3":
        p = config["patch_size"]
        return (latent[0] // p, latent[1] // p)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


CASES: dict[str, Case] = {
    c.key: c
    for c in (
        Case(
            "wan14b-720p", "Wan2.1-14B-shaped, 720p 81 frames", "wan", WAN_14B, (21, 90, 160), 512, 0.125, 1, 10,
            Paper(1.91, 2.75, 1564.0, 818.0, "Wan2.1-14B T2V 720p, 87.5% sparsity, warm-up 1 layer / 10 steps"),
            compile_fraction=0.1,
        ),
        Case(
            "hunyuan-720p", "HunyuanVideo-shaped, 720p 129 frames", "hunyuan", HUNYUAN_VIDEO, (33, 90, 160), 256,
            0.125, 1, 10,
            Paper(2.57, 3.82, 1651.0, 641.0, "HunyuanVideo 13B T2V 720p, 87.5% sparsity, warm-up 1 layer / 10 steps"),
            compile_fraction=0.1,
        ),
        Case(
            "flux-1024", "FLUX.1-dev-shaped, 1024x1024", "flux", FLUX_DEV, (64, 64), 512, 0.15, 4, 0,
            Paper(8.32 / 6.87, None, 8.32, 6.87, "FLUX.1-dev 1024x1024, 85% sparsity, warm-up 4 layers / 0 steps"),
            compile_fraction=0.1,
        ),
        Case("flux-2048", "FLUX.1-dev-shaped, 2048x2048", "flux", FLUX_DEV, (128, 128), 512, 0.15, 4, 0,
             compile_fraction=0.1),  # fmt: skip
        Case(
            "sd35-1024", "SD3.5-Large-shaped, 1024x1024", "sd3", SD35_LARGE, (128, 128), 333, 0.15, 4, 0,
            Paper(0.81 / 0.65, None, 0.81, 0.65, "SD3.5-Large Turbo 1024x1024, 85% sparsity (its image table)"),
            compile_fraction=0.1,
        ),
        Case(
            "wan1.3b-480p", "Wan2.1-1.3B-shaped, 480p 81 frames", "wan", WAN_1_3B, (21, 60, 104), 512, 0.125, 1, 15,
            Paper(2.04, 3.06, 98.0, 48.0, "Wan2.1-1.3B T2V 480p, 87.5% sparsity, warm-up 1 layer / 15 steps"),
            compile_fraction=1.0,
        ),
    )
}

# Tiny stand-ins (same classes and code paths) for CPU checks of the benchmark scripts.
_TINY = {
    "wan": dict(config=WAN_TINY, latent=(3, 12, 20), text=8),
    "hunyuan": dict(config=HUNYUAN_TINY, latent=(3, 12, 20), text=16, text_valid=12),
    "flux": dict(config=FLUX_TINY, latent=(16, 16), text=16),
    "sd3": dict(config=SD3_TINY, latent=(32, 32), text=16),
}


def tiny(case: Case) -> Case:
    """``case`` with a tiny config of the same class (FLUX's larger size gets a larger tiny grid)."""
    t = dict(_TINY[case.family])
    if case.family == "flux" and case.image_tokens > 4096:
        t["latent"] = (24, 24)
    return replace(case, title=f"{case.title} (tiny)", compile_fraction=min(case.compile_fraction * 5, 1.0), **t)


def reduced(case: Case, fraction: float) -> Case:
    """``case`` with ``fraction`` of its blocks (each block kind scaled, at least one of each)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return case
    cfg = dict(case.config)
    for k in ("num_layers", "num_single_layers"):
        if k in cfg:
            cfg[k] = max(1, round(cfg[k] * fraction))
    return replace(case, config=cfg)


# --- models and inputs ---------------------------------------------------------------------------
def build(case: Case, device, dtype) -> torch.nn.Module:
    """The case's transformer with random weights created directly on ``device`` in ``dtype``."""
    import diffusers

    cls = getattr(diffusers, _CLASSES[case.family])
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(**case.config)
    finally:
        torch.set_default_dtype(previous)
    # As from_pretrained(torch_dtype=...) does: the model's precision-sensitive tensors stay fp32.
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if keep & set(name.split(".")) and t.is_floating_point():
            t.data = t.data.float()
    return model.eval().requires_grad_(False)


def inputs(case: Case, device, dtype) -> dict:
    """Forward keyword arguments as the family's pipeline passes them (random latents and prompt)."""
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    cfg = case.config
    if case.family == "wan":
        return dict(
            hidden_states=r(1, cfg["in_channels"], *case.latent), timestep=torch.tensor([500.0], device=device),
            encoder_hidden_states=r(1, case.text, cfg["text_dim"]),
        )  # fmt: skip
    if case.family == "hunyuan":
        mask = torch.zeros(1, case.text, dtype=torch.long, device=device)
        mask[:, : case.text if case.text_valid is None else case.text_valid] = 1
        return dict(
            hidden_states=r(1, cfg["in_channels"], *case.latent), timestep=torch.tensor([500.0], device=device),
            encoder_hidden_states=r(1, case.text, cfg["text_embed_dim"]), encoder_attention_mask=mask,
            pooled_projections=r(1, cfg["pooled_projection_dim"]),
            guidance=torch.tensor([6000.0], device=device, dtype=dtype),
        )  # fmt: skip
    if case.family == "sd3":
        return dict(
            hidden_states=r(1, cfg["in_channels"], *case.latent), encoder_hidden_states=r(1, case.text,
            cfg["joint_attention_dim"]), pooled_projections=r(1, cfg["pooled_projection_dim"]),
            timestep=torch.tensor([500.0], device=device),
        )  # fmt: skip
    h, w = case.latent
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    out = dict(
        hidden_states=r(1, h * w, cfg["in_channels"]), encoder_hidden_states=r(1, case.text, cfg["joint_attention_dim"]),
        pooled_projections=r(1, cfg["pooled_projection_dim"]), timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=ids.reshape(h * w, 3).to(device), txt_ids=torch.zeros(case.text, 3, device=device),
    )  # fmt: skip
    if cfg.get("guidance_embeds"):
        out["guidance"] = torch.tensor([3.5], device=device, dtype=dtype)
    return out


def self_attention_mask(case: Case, device) -> torch.Tensor | None:
    """The mask the transformer passes to its managed self-attention calls (Hunyuan: a
    ``[1, 1, 1, L]`` bool key-padding mask, built by the model from the prompt mask), or None."""
    if case.family != "hunyuan":
        return None
    n = case.image_tokens + case.text
    valid = case.image_tokens + (case.text if case.text_valid is None else case.text_valid)
    return (torch.arange(n, device=device) < valid)[None, None, None, :]

