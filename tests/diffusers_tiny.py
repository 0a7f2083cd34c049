"""Tiny random-weight diffusers transformers and pipelines for offline CPU tests (no downloads).

Every model has 2 heads of dim 16 and hidden size 32; grids are small (16x16 images, 3x6x10
videos, ragged against 2x2x4 / 4x4 tiles of 16 tokens). Pipelines have no VAE or text encoders:
call them with :func:`prompt_kwargs` (random prompt embeddings) and ``output_type="latent"``.
Reusable by other test files: ``from diffusers_tiny import tiny_pipeline, prompt_kwargs, ...``.
"""

from __future__ import annotations

import torch

FAMILIES = ("flux", "sd3", "wan", "hunyuan")
TEXT_DIM = 32
TEXT_LEN = 16  # FLUX text tokens: one 16-token block before the image
TILE_BLOCK = 16  # block size the tests use (tile volume of the default tiles)
# Image/video size per family: FLUX/SD3 16x16 tokens; Wan/Hunyuan 3x6x10 (9 frames, 96x160).
SIZES = {
    "flux": dict(height=256, width=256),
    "sd3": dict(height=256, width=256),
    "wan": dict(height=96, width=160, num_frames=9),
    "hunyuan": dict(height=96, width=160, num_frames=9),
}
GRIDS = {"flux": (16, 16), "sd3": (16, 16), "wan": (3, 6, 10), "hunyuan": (3, 6, 10)}


def _seeded(seed: int):
    torch.manual_seed(seed)


def tiny_transformer(family: str, seed: int = 0, **overrides):
    """A tiny random-weight transformer of ``family`` built from its config."""
    _seeded(seed)
    if family == "flux":
        from diffusers import FluxTransformer2DModel

        cfg = dict(
            patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
            guidance_embeds=False, axes_dims_rope=(4, 6, 6),
        )
        return FluxTransformer2DModel(**{**cfg, **overrides}).eval()
    if family == "sd3":
        from diffusers import SD3Transformer2DModel

        cfg = dict(
            sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=TEXT_DIM, caption_projection_dim=32, pooled_projection_dim=TEXT_DIM, out_channels=4,
            pos_embed_max_size=32, dual_attention_layers=(0,),
        )
        return SD3Transformer2DModel(**{**cfg, **overrides}).eval()
    if family == "wan":
        from diffusers import WanTransformer3DModel

        cfg = dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
        )
        return WanTransformer3DModel(**{**cfg, **overrides}).eval()
    if family == "hunyuan":
        from diffusers import HunyuanVideoTransformer3DModel

        cfg = dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=TEXT_DIM,
            pooled_projection_dim=TEXT_DIM, rope_axes_dim=(4, 6, 6), guidance_embeds=True,
        )
        return HunyuanVideoTransformer3DModel(**{**cfg, **overrides}).eval()
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def attention_layers(family: str) -> int:
    """Managed self-attention layers per forward of :func:`tiny_transformer` (default config)."""
    return {"flux": 4, "sd3": 3, "wan": 2, "hunyuan": 2}[family]


def tiny_pipeline(family: str, seed: int = 0, transformer=None):
    """The family's diffusers pipeline around a tiny transformer, without VAE or text encoders."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    tr = transformer if transformer is not None else tiny_transformer(family, seed)
    sched = FlowMatchEulerDiscreteScheduler()
    if family == "flux":
        from diffusers import FluxPipeline

        return FluxPipeline(
            scheduler=sched, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
            transformer=tr,
        )
    if family == "sd3":
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline(
            transformer=tr, scheduler=sched, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
            tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
        )
    if family == "wan":
        from diffusers import WanPipeline

        return WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=sched, transformer=tr)
    if family == "hunyuan":
        from diffusers import HunyuanVideoPipeline

        return HunyuanVideoPipeline(
            text_encoder=None, tokenizer=None, transformer=tr, vae=None, scheduler=sched, text_encoder_2=None,
            tokenizer_2=None,
        )
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def prompt_kwargs(family: str, seed: int = 0, batch: int = 1) -> dict:
    """Pipeline keyword arguments: random prompt embeddings, size, latent output, CFG where the
    pipeline batches or repeats it (SD3 batched, Wan two calls per step)."""
    g = torch.Generator().manual_seed(seed + 1000)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    kw = dict(SIZES[family], output_type="latent", generator=torch.Generator().manual_seed(seed))
    if family == "flux":
        kw.update(prompt_embeds=r(batch, TEXT_LEN, TEXT_DIM), pooled_prompt_embeds=r(batch, TEXT_DIM))
    elif family == "sd3":
        kw.update(
            prompt_embeds=r(batch, 8, TEXT_DIM), pooled_prompt_embeds=r(batch, TEXT_DIM),
            negative_prompt_embeds=r(batch, 8, TEXT_DIM), negative_pooled_prompt_embeds=r(batch, TEXT_DIM),
            guidance_scale=3.0,
        )
    elif family == "wan":
        kw.update(prompt_embeds=r(batch, 8, TEXT_DIM), negative_prompt_embeds=r(batch, 8, TEXT_DIM), guidance_scale=3.0)
    elif family == "hunyuan":
        mask = torch.zeros(batch, 8, dtype=torch.long)
        mask[:, :5] = 1  # 5 real text tokens, 3 padding tokens
        kw.update(
            prompt_embeds=r(batch, 8, TEXT_DIM), pooled_prompt_embeds=r(batch, TEXT_DIM), prompt_attention_mask=mask,
        )
    return kw


def forward_inputs(family: str, seed: int = 0, batch: int = 1, timestep: float = 0.7) -> dict:
    """Direct transformer-forward keyword arguments (random latents and text) for ``family``."""
    g = torch.Generator().manual_seed(seed + 2000)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = torch.full((batch,), timestep)
    if family == "flux":
        h, w = GRIDS["flux"]
        ids = torch.zeros(h, w, 3)
        ids[..., 1] = torch.arange(h)[:, None]
        ids[..., 2] = torch.arange(w)[None, :]
        return dict(
            hidden_states=r(batch, h * w, 16), encoder_hidden_states=r(batch, TEXT_LEN, TEXT_DIM),
            pooled_projections=r(batch, TEXT_DIM), timestep=t, img_ids=ids.reshape(h * w, 3),
            txt_ids=torch.zeros(TEXT_LEN, 3),
        )
    if family == "sd3":
        h, w = GRIDS["sd3"]
        return dict(
            hidden_states=r(batch, 4, 2 * h, 2 * w), encoder_hidden_states=r(batch, 8, TEXT_DIM),
            pooled_projections=r(batch, TEXT_DIM), timestep=t * 1000,
        )
    if family == "wan":
        f, h, w = GRIDS["wan"]
        return dict(hidden_states=r(batch, 4, f, 2 * h, 2 * w), encoder_hidden_states=r(batch, 8, TEXT_DIM), timestep=t * 1000)
    if family == "hunyuan":
        f, h, w = GRIDS["hunyuan"]
        mask = torch.zeros(batch, 8, dtype=torch.long)
        mask[:, :5] = 1
        return dict(
            hidden_states=r(batch, 4, f, 2 * h, 2 * w), encoder_hidden_states=r(batch, 8, TEXT_DIM),
            encoder_attention_mask=mask, pooled_projections=r(batch, TEXT_DIM), timestep=t * 1000,
            guidance=torch.full((batch,), 6000.0),
        )
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def save_tiny_wan_pipeline(path) -> str:
    """A complete tiny Wan pipeline (word-level tokenizer, 1-layer UMT5 encoder, small Wan VAE,
    tiny transformer) written with ``save_pretrained`` to ``path``, loadable by
    ``DiffusionPipeline.from_pretrained(path)``; returns ``str(path)``."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    words = ["[PAD]", "[UNK]", "</s>"] + "a an the cat dog red blue on in sky grass sitting flying".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>")
    _seeded(0)
    encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(words), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                   relative_attention_num_buckets=8)
    ).eval()  # fmt: skip
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()  # fmt: skip
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=encoder, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
        transformer=tiny_transformer("wan"),
    )  # fmt: skip
    pipe.save_pretrained(str(path))
    return str(path)
