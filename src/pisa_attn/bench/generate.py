"""``pisa-attn generate``: render an image or video with a diffusers pipeline on PISA.

Loads the pipeline with ``DiffusionPipeline.from_pretrained`` (hub id or local directory; local
files only when ``HF_HUB_OFFLINE=1`` or the hub is unreachable), applies :func:`apply_pisa`, runs it
with the pipeline's progress bar and saves the result. ``--compare-dense`` first renders the dense
result with the same seed and reports PSNR / SSIM (scikit-image) and LPIPS (torchmetrics, only
when its backbone weights are already in the local torch hub cache).

Heavy imports (torch, diffusers) happen inside the command so registering the parser is cheap.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from . import argtypes as at

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_EXTS = (".mp4", ".gif")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# torchvision's AlexNet checkpoint, the LPIPS backbone torchmetrics loads (never downloaded here).
LPIPS_BACKBONE = "alexnet-owt-7be5be79.pth"


class ModelUnavailableError(RuntimeError):
    """The pipeline's files are not on this machine and cannot be downloaded."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``generate`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "generate",
        help="render an image/video with a diffusers pipeline (FLUX.1, SD3.5, Wan2.1, HunyuanVideo) on PISA",
        description=__doc__.split("\n\n")[0],
    )
    # Values are checked in _check_args (run), so that run() on a hand-built Namespace checks them too.
    p.add_argument("--model", required=True, help="hub id (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers) or local pipeline directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--out", required=True, help="output file: .png/.jpg/.webp (images) or .mp4/.gif (videos)")
    p.add_argument("--density", type=float, default=0.15, help="fraction of key blocks computed exactly, in (0, 1]")
    p.add_argument("--mode", default="hybrid", choices=("hybrid", "zeroth", "first", "drop"))
    p.add_argument("--dense-layers", type=int, default=None,
                   help="first transformer blocks kept dense, >= 0 (default: per model)")
    p.add_argument("--dense-steps", type=int, default=None,
                   help="first denoising steps kept dense, >= 0 (default: per model)")
    p.add_argument("--block-size", type=int, default=64, help="a power of two >= 16")
    p.add_argument("--min-kv-len", type=int, default=None,
                   help="attention calls with fewer keys stay dense (default 9216: below that PISA is slower than dense)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps, >= 1 (default: the pipeline's)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the pipeline's)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the pipeline's)")
    p.add_argument("--frames", type=int, default=None, help="video frames, video models only (default: the pipeline's)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the pipeline's)")
    p.add_argument("--seed", type=int, default=0, help="an integer >= 0")
    p.add_argument("--fps", type=int, default=16, help="frame rate of saved videos, >= 1")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    p.add_argument("--compare-dense", action="store_true", help="also render dense with the same seed and report PSNR/SSIM/LPIPS")
    p.set_defaults(func=run)
    return p


def _render_or_fail(pipe, kwargs, seed, video, label):
    """:func:`render`, with a value the pipeline refuses (a size it cannot take, ...) as one error line."""
    try:
        return render(pipe, kwargs, seed, video, label)
    except ValueError as e:
        _fail(f"{type(pipe).__name__} refused the call ({label}): {e}")


def _fail(msg: str, code: int = 2):
    """One error line on stderr and exit ``code``: 2 for a usage error (as argparse and the other
    commands exit), 1 for a run that could not be done (weights not available)."""
    print(f"pisa-attn generate: error: {msg}", file=sys.stderr)
    raise SystemExit(code)


# What the command imports beyond the core install (top-level module names).
NEEDS = ("diffusers", "transformers", "PIL")
NEEDS_COMPARE = ("skimage",)
NEEDS_VIDEO = ("imageio",)


def _check_args(args) -> None:
    """Everything that can be checked before the pipeline loads: values, paths, dependencies."""
    if not 0.0 < args.density <= 1.0:
        _fail(f"--density must be in (0, 1], got {args.density}")
    if args.block_size < 16 or args.block_size & (args.block_size - 1):
        _fail(f"--block-size must be a power of two >= 16, got {args.block_size}")
    if args.seed < 0:
        _fail(f"--seed must be >= 0, got {args.seed}")
    if args.guidance is not None and not math.isfinite(args.guidance):
        _fail(f"--guidance must be a finite number, got {args.guidance}")
    if args.model.startswith(("/", "./", "../", "~")) and not Path(args.model).expanduser().is_dir():
        _fail(f"--model {args.model!r} is a path but not a directory (a pipeline saved with save_pretrained)")
    for name in ("steps", "height", "width", "frames", "fps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            _fail(f"--{name} must be >= 1, got {value}")
    for name in ("dense_layers", "dense_steps", "min_kv_len"):
        value = getattr(args, name)
        if value is not None and value < 0:
            _fail(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    ext = Path(args.out).suffix.lower()
    if ext not in IMAGE_EXTS + VIDEO_EXTS:
        _fail(f"--out must end in one of {IMAGE_EXTS + VIDEO_EXTS}, got {args.out!r}")
    needs = NEEDS + (NEEDS_COMPARE if args.compare_dense else ()) + (NEEDS_VIDEO if ext in VIDEO_EXTS else ())
    missing = at.missing_modules(*needs)
    if missing:
        _fail(f"needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
              "pip install 'pisa-attn[diffusers]'")
    if ext == ".mp4" and at.missing_modules("imageio_ffmpeg"):
        _fail("writing .mp4 needs imageio-ffmpeg (pip install imageio-ffmpeg), or use --out video.gif")
    if Path(args.out).is_dir() or not Path(args.out).resolve().parent.is_dir():
        _fail(f"the directory of --out does not exist or --out is a directory: {args.out}")
    if args.device is not None:
        _check_device(args.device)


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        _fail(f"--device {device!r} is not a torch device ({e})")
    if dev.type not in ("cpu", "cuda"):
        _fail(f"--device must be cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        _fail(f"--device {device!r}: CUDA is not available on this machine")


# --- loading -----------------------------------------------------------------------------------
def _hub_offline() -> bool:
    """HF_HUB_OFFLINE is set, or the hub endpoint does not accept a connection within 3 s."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError:
        return True
    return False


def load_pipeline(model: str, torch_dtype, device: str):
    """``DiffusionPipeline.from_pretrained`` with a clear :class:`ModelUnavailableError` when the
    files are neither local nor downloadable."""
    from diffusers import DiffusionPipeline

    local = Path(model).expanduser().is_dir()
    offline = not local and _hub_offline()
    try:
        pipe = DiffusionPipeline.from_pretrained(
            str(Path(model).expanduser()) if local else model, dtype=torch_dtype, local_files_only=local or offline
        )
    except (OSError, ValueError) as e:
        if local:
            raise ModelUnavailableError(f"cannot load the pipeline in {model!r}: it is not a diffusers pipeline folder "
                                        f"(save_pretrained writes model_index.json beside the components): {e}") from e
        where = "hub id"
        why = " (offline: HF_HUB_OFFLINE=1 or the hub is unreachable, so only the local cache was searched)" if offline else ""
        raise ModelUnavailableError(
            f"cannot load the pipeline {model!r} ({where}){why}: {e}\n"
            f"Model weights cannot be downloaded on this machine. Fetch them where the hub is reachable "
            f"(huggingface-cli download {model} --local-dir DIR) and pass --model DIR, or copy the Hugging Face "
            f"cache (HF_HOME) here."
        ) from e
    return pipe.to(device)


# --- rendering ---------------------------------------------------------------------------------
def _call_kwargs(args, video: bool) -> dict:
    kw = dict(prompt=args.prompt, output_type="np")
    for arg, name in (("steps", "num_inference_steps"), ("height", "height"), ("width", "width"), ("guidance", "guidance_scale")):
        if getattr(args, arg) is not None:
            kw[name] = getattr(args, arg)
    if args.frames is not None:
        if not video:
            _fail("--frames applies to video models only")
        kw["num_frames"] = args.frames
    return kw


def render(pipe, kwargs: dict, seed: int, video: bool, desc: str):
    """Run the pipeline; returns (uint8 frames [F, H, W, 3], seconds)."""
    import numpy as np
    import torch

    pipe.set_progress_bar_config(desc=desc)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        result = pipe(**kwargs, generator=generator)
    sync()
    seconds = time.perf_counter() - t0
    frames = np.asarray(result.frames[0] if video else result.images)
    frames = (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)
    return frames.reshape(-1, *frames.shape[-3:]), seconds


def save(frames, path: str, fps: int) -> None:
    from PIL import Image

    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTS:
        Image.fromarray(frames[0]).save(path)
    elif ext == ".gif":
        images = [Image.fromarray(f) for f in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    else:
        import imageio.v2 as imageio

        imageio.mimwrite(path, list(frames), fps=fps, macro_block_size=1)


# --- metrics -----------------------------------------------------------------------------------
def similarity(a, b) -> dict:
    """PSNR (dB) and SSIM of two uint8 frame stacks [F, H, W, 3], averaged over frames."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    # Identical frames have no error: PSNR is infinite (skimage would divide by zero).
    psnr = [float("inf") if (x == y).all() else peak_signal_noise_ratio(x, y, data_range=255) for x, y in zip(a, b)]
    ssim = [structural_similarity(x, y, channel_axis=-1, data_range=255) for x, y in zip(a, b)]
    return {"psnr": float(sum(psnr) / len(psnr)), "ssim": float(sum(ssim) / len(ssim))}


def lpips(a, b) -> tuple[float | None, str]:
    """LPIPS (AlexNet) of two uint8 frame stacks, or (None, why not): computed only when
    torchmetrics is installed and the backbone weights are in the local torch hub cache."""
    import torch

    try:
        from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity
    except ImportError:
        return None, "torchmetrics (with torchvision) is not installed"
    ckpt = Path(torch.hub.get_dir()) / "checkpoints" / LPIPS_BACKBONE
    if not ckpt.is_file():
        return None, f"LPIPS backbone weights not found locally ({ckpt})"
    metric = LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True)
    to = lambda x: torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255  # noqa: E731
    with torch.no_grad():
        return float(metric(to(a), to(b))), ""


# --- the command -------------------------------------------------------------------------------
def _print_summary(rows: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pisa-attn generate", show_header=False)
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def run(args) -> int:
    """Entry point of ``pisa-attn generate`` (``args`` from :func:`add_parser`)."""
    _check_args(args)
    import torch

    from ..diffusers import adapter_for, apply_pisa, stats

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    try:
        pipe = load_pipeline(args.model, getattr(torch, DTYPES[dtype_name]), device)
    except ModelUnavailableError as e:
        _fail(str(e), code=1)
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        _fail(f"{type(pipe).__name__} has no transformer; supported: FLUX.1, SD3/3.5, Wan2.1, HunyuanVideo pipelines")
    try:
        adapter = adapter_for(transformer)
    except TypeError as e:
        _fail(str(e))
    video = adapter.ndim == 3
    ext = Path(args.out).suffix.lower()
    if video != (ext in VIDEO_EXTS):
        _fail(f"{type(pipe).__name__} makes {'videos' if video else 'images'}; --out {args.out!r} does not match")
    kwargs = _call_kwargs(args, video)

    rows: list[tuple[str, str]] = [("model", f"{args.model} ({adapter.name}, {dtype_name}, {device})")]
    dense = None
    if args.compare_dense:
        dense, t_dense = _render_or_fail(pipe, kwargs, args.seed, video, "dense")
        rows.append(("dense time", f"{t_dense:.2f} s"))
    extra = {} if args.min_kv_len is None else {"min_kv_len": args.min_kv_len}
    apply_pisa(
        pipe, density=args.density, dense_layers=args.dense_layers, dense_steps=args.dense_steps, mode=args.mode,
        block_size=args.block_size, **extra,
    )  # fmt: skip
    sparse, t_sparse = _render_or_fail(pipe, kwargs, args.seed, video, f"PISA {args.density:g}")
    save(sparse, args.out, args.fps)
    counts = stats(transformer)
    rows += [
        ("PISA time", f"{t_sparse:.2f} s"),
        ("attention calls", f"{counts.get('sparse', 0)} sparse, {counts.get('dense', 0)} dense"),
        ("output", args.out),
    ]
    if dense is not None:
        out = Path(args.out)
        dense_path = str(out.with_name(f"{out.stem}_dense{out.suffix}"))
        save(dense, dense_path, args.fps)
        sim = similarity(sparse, dense)
        rows += [("dense output", dense_path), ("speedup", f"{t_dense / t_sparse:.2f}x")]
        rows += [("PSNR vs dense", f"{sim['psnr']:.2f} dB"), ("SSIM vs dense", f"{sim['ssim']:.4f}")]
        value, why = lpips(sparse, dense)
        rows.append(("LPIPS vs dense", f"{value:.4f}" if value is not None else f"skipped: {why}"))
    _print_summary(rows)
    return 0
