"""The ``generate`` subcommand: argument parsing, error paths, and a run on a tiny saved pipeline."""

import argparse

import re

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from pisa_attn.bench import generate  # noqa: E402


def _parse(argv):
    parser = argparse.ArgumentParser(prog="pisa-attn")
    generate.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_parser_defaults_and_values():
    args = _parse(["generate", "--model", "m", "--prompt", "a cat", "--out", "x.png"])
    assert args.func is generate.run and args.command == "generate"
    assert (args.density, args.mode, args.seed, args.block_size) == (0.15, "hybrid", 0, 64)
    assert args.steps is args.height is args.frames is args.dense_layers is args.dtype is None and not args.compare_dense
    args = _parse(
        ["generate", "--model", "m", "--prompt", "p", "--out", "v.mp4", "--density", "0.125", "--steps", "4",
         "--height", "480", "--width", "832", "--frames", "81", "--seed", "7", "--compare-dense", "--dense-steps", "0"]
    )  # fmt: skip
    assert (args.density, args.steps, args.height, args.width, args.frames, args.seed) == (0.125, 4, 480, 832, 81, 7)
    assert args.compare_dense and args.dense_steps == 0
    with pytest.raises(SystemExit):
        _parse(["generate", "--prompt", "p", "--out", "x.png"])  # --model is required


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--out", "x.bmp"], "--out must end"),
        (["--out", "x.png", "--density", "0"], "--density"),
        (["--out", "x.png", "--steps", "0"], "--steps"),
        (["--out", "/nonexistent_dir_pisa/x.png"], "directory of --out"),
        (["--out", "x.png", "--dense-layers", "-1"], "--dense-layers"),
        (["--out", "x.png", "--guidance", "nan"], "--guidance"),
        (["--out", "x.png", "--model", "/nonexistent_dir_pisa/pipe"], "--model .* is a path but not a directory"),
    ],
)
def test_bad_arguments_fail_before_loading(extra, match, capsys):
    args = _parse(["generate", "--model", "org/does-not-exist", "--prompt", "p", *extra])
    with pytest.raises(SystemExit) as e:
        generate.run(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(match, err) and err.count("\n") == 1, err  # one line, exit 2


def test_missing_weights_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert generate._hub_offline()
    args = _parse(["generate", "--model", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--prompt", "p", "--out", str(tmp_path / "v.mp4")])
    with pytest.raises(SystemExit) as e:
        generate.run(args)
    msg = capsys.readouterr().err
    assert e.value.code == 1
    assert "cannot load the pipeline 'Wan-AI/Wan2.1-T2V-1.3B-Diffusers'" in msg and "offline" in msg
    assert "cannot be downloaded on this machine" in msg and "--model DIR" in msg
    with pytest.raises(generate.ModelUnavailableError, match="not a diffusers pipeline folder"):
        generate.load_pipeline(str(tmp_path), torch.float32, "cpu")  # an empty directory is no pipeline


def test_similarity_metrics():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-8, 9, a.shape), 0, 255).astype(np.uint8)
    same = generate.similarity(a, a)
    assert same["psnr"] == float("inf") and same["ssim"] == pytest.approx(1.0)
    close = generate.similarity(a, b)
    assert 25 < close["psnr"] < 40 and 0.5 < close["ssim"] < 1.0


def test_generate_tiny_saved_pipeline(tmp_path, capsys):
    pytest.importorskip("accelerate", reason="diffusers loads Wan's fp32-kept modules only with accelerate")
    pytest.importorskip("imageio_ffmpeg", reason="writing .mp4 needs imageio-ffmpeg")
    from diffusers_tiny import save_tiny_wan_pipeline

    model = save_tiny_wan_pipeline(tmp_path / "tiny-wan")
    out = tmp_path / "video.mp4"
    args = _parse(
        ["generate", "--model", model, "--prompt", "a red cat on the grass", "--out", str(out), "--density", "0.25",
         "--steps", "2", "--height", "96", "--width", "160", "--frames", "9", "--dense-steps", "1", "--dense-layers",
         "0", "--block-size", "16", "--min-kv-len", "0", "--compare-dense", "--device", "cpu"]
    )  # fmt: skip
    assert generate.run(args) == 0
    assert out.is_file() and (tmp_path / "video_dense.mp4").is_file()
    import imageio.v2 as imageio

    frames = imageio.mimread(str(out))
    assert len(frames) == 9 and frames[0].shape == (96, 160, 3)
    text = capsys.readouterr().out
    assert "PSNR vs dense" in text and "SSIM vs dense" in text and "LPIPS vs dense" in text
    assert "4 sparse, 4 dense" in text  # 2 layers x (cond, uncond) per step: step 0 dense, step 1 sparse
    with pytest.raises(SystemExit) as e:
        generate.run(_parse(["generate", "--model", model, "--prompt", "p", "--out", str(tmp_path / "x.png"), "--device", "cpu"]))
    assert e.value.code == 2 and "makes videos" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a size the pipeline refuses: its words, one line
        generate.run(_parse(["generate", "--model", model, "--prompt", "p", "--out", str(tmp_path / "y.mp4"),
                             "--height", "50", "--width", "50", "--frames", "9", "--steps", "1", "--device", "cpu"]))
    assert e.value.code == 2 and "WanPipeline refused the call" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["mps", "meta"])
def test_a_device_other_than_cpu_or_cuda_is_one_error_line(device, capsys):
    from pisa_attn.bench.generate import _check_device

    with pytest.raises(SystemExit):
        _check_device(device)
    assert "--device must be cpu or cuda[:N]" in capsys.readouterr().err
