"""Transformer configs the GPU benchmarks build with random weights (diffusers constructor kwargs).

The real configs are those of the public diffusers checkpoints; the tiny ones have the same
classes and code paths for CPU checks of the scripts.
"""

# Wan2.1-T2V-1.3B (diffusers WanTransformer3DModel), -14B, and a tiny one for CPU checks.
WAN_1_3B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
# Wan2.1-T2V-14B: hidden 5120 = 40 heads x 128, FFN 13824, 40 layers.
WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
WAN_TINY = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
    text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
)  # fmt: skip
# FLUX.1-dev (diffusers FluxTransformer2DModel), and a tiny one.
FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)  # fmt: skip
FLUX_TINY = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)  # fmt: skip
# HunyuanVideo (diffusers HunyuanVideoTransformer3DModel; the checkpoint's config is the class
# defaults: 20 dual-stream + 40 single-stream blocks, 24 heads x 128), and a tiny one.
HUNYUAN_VIDEO = dict(
    in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
)  # fmt: skip
HUNYUAN_TINY = dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=2,
    num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=32, pooled_projection_dim=32,
    rope_axes_dim=(4, 6, 6), guidance_embeds=True,
)  # fmt: skip
# Stable Diffusion 3.5 Large (diffusers SD3Transformer2DModel): 38 blocks, 38 heads x 64, and a tiny one.
SD35_LARGE = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64, num_attention_heads=38,
    joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=192, qk_norm="rms_norm", dual_attention_layers=(),
)  # fmt: skip
SD3_TINY = dict(
    sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
    pos_embed_max_size=32,
)  # fmt: skip
