"""Q/K/V capture from tiny offline diffusers pipelines: file round trip, metadata, study on it."""

import math

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

import pisa_attn.diffusers as pd  # noqa: E402
from diffusers_tiny import GRIDS, TEXT_LEN, prompt_kwargs, tiny_pipeline  # noqa: E402
from pisa_attn.bench.study import StudyConfig, run_study  # noqa: E402
from pisa_attn.diffusers import hooks  # noqa: E402
from pisa_attn.diffusers.capture import capture_qkv  # noqa: E402
from pisa_attn.qkv_file import layout_from_json, layout_to_json, read_qkv_file, trim_layout  # noqa: E402
from pisa_attn.layout import make_layout, raster  # noqa: E402


def _watch(transformer):
    """What the backend hands observers, per (step, layer): the first call's q/k/v (batch row 0)."""
    seen = {}

    def observe(call):
        seen.setdefault((call.step, call.layer), tuple(x[:1].clone() for x in (call.q, call.k, call.v)))

    return seen, hooks.add_observer(transformer, observe)


@pytest.fixture(scope="module")
def flux_capture(tmp_path_factory):
    path = tmp_path_factory.mktemp("cap") / "flux.safetensors"
    pipe = tiny_pipeline("flux")
    seen, unwatch = _watch(pipe.transformer)
    with capture_qkv(pipe, layers=[0, 2], steps=range(2), path=path) as cap:
        pipe(**prompt_kwargs("flux"), num_inference_steps=3)
    unwatch()
    return pipe, cap, seen, path


def test_flux_capture_round_trips_tensors_and_metadata(flux_capture):
    pipe, cap, seen, path = flux_capture
    assert pd.capture_qkv is capture_qkv  # the package exports it
    assert pd.pisa_state(pipe.transformer) is None  # the capture applied PISA and removed it
    f = read_qkv_file(str(path))
    names = ["step0.layer0", "step0.layer2", "step1.layer0", "step1.layer2"]
    assert [e.name for e in f.entries] == names == cap.names
    h, w = GRIDS["flux"]
    length = TEXT_LEN + h * w
    assert f.meta["model"] == "flux" and f.meta["grid"] == [h, w] and f.meta["text_len"] == TEXT_LEN
    assert f.meta["dtype"] == "float32" and f.meta["tile"] == [8, 8]
    for e in f.entries:
        q, k, v = seen[(e.step, e.layer)]
        assert e.q.shape == (1, 2, length, 16)
        assert torch.equal(e.q, q) and torch.equal(e.k, k) and torch.equal(e.v, v)
        assert e.layout.num_tokens == length and e.layout.num_text_tokens == TEXT_LEN
        assert e.layout.grid_shape == (h, w) and e.layout.tile == (8, 8)
        assert e.info["image_range"] == [TEXT_LEN, length] and e.info["key_len"] == length
        assert e.info["density"] == 1.0 and e.info["pisa_applied_by_capture"] is True
        assert e.info["dense"] is True and e.info["scale"] == 16**-0.5  # captures run exact, dense attention


def test_study_runs_on_a_capture(flux_capture):
    _, _, _, path = flux_capture
    cfg = StudyConfig(source=str(path), block_size=16, densities=(0.25, 1.0), lengths=(1, 2), modes=("drop", "hybrid"),
                      covariance=False, plots=False, max_entries=2)
    r = run_study(cfg, progress=False)
    assert r["source"]["kind"] == "safetensors" and r["source"]["entries"] == ["step0.layer0", "step0.layer2"]
    ds = r["density_sweep"]
    assert ds["length"] == TEXT_LEN + 256 and set(ds["rel_l1_per_sample"]) == {"step0.layer0", "step0.layer2"}
    assert all(errs[1] < 1e-5 < errs[0] for errs in ds["rel_l1"].values())
    assert r["length_sweep"]["lengths"] == [TEXT_LEN + 128, TEXT_LEN + 256]  # a crop of half the grid
    assert r["tiling"]["tiled"]["rel_l1"]["drop"][1] < 1e-5


def test_padded_text_keys_are_trimmed(tmp_path):
    pipe = tiny_pipeline("hunyuan")
    path = tmp_path / "hy.safetensors"
    with capture_qkv(pipe, steps=0, path=path, dtype=torch.bfloat16):
        pipe(**prompt_kwargs("hunyuan"), num_inference_steps=2)
    f = read_qkv_file(str(path))
    n_grid = 3 * 6 * 10
    assert f.meta["dtype"] == "bfloat16" and len(f.entries) == 2
    for e in f.entries:
        assert e.info["dense"] is True  # dense calls too give observers the valid keys per row
        assert e.info["key_len"] == n_grid + 5  # 5 valid of 8 text tokens
        assert e.q.shape[2] == e.k.shape[2] == n_grid + 5 and e.q.dtype == torch.bfloat16
        assert e.layout.num_tokens == n_grid + 5 and e.layout.num_text_tokens == 5
        assert e.info["text_len"] == 5  # the text tokens the entry holds (it said the call's 8)
    assert f.meta["text_len"] == 5


def test_captured_scale_reaches_the_study(tmp_path):
    # A call with a non-default softmax scale: the file records it and the study's samples (which
    # use the default scale) attend as that call did.
    from pisa_attn.bench.study_sources import CapturedSource

    tr = tiny_pipeline("wan").transformer
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
    call = hooks.AttentionCall(model="wan", layer=0, step=0, q=q, k=k, v=v, out=out, dense=True, density=1.0,
                               mode="hybrid", covariance_aware=False, block_size=16, scale=0.5)
    path = tmp_path / "scaled.safetensors"
    with capture_qkv(tr, path=path):
        hooks.notify(tr, call)
    (e,) = read_qkv_file(str(path)).entries
    assert e.info["scale"] == 0.5
    (s,) = CapturedSource(str(path), dtype=torch.float32, device="cpu").fixed()
    torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(s.q, s.k, s.v), out)


def test_capture_keeps_users_pisa_and_first_call_wins(tmp_path):
    pipe = tiny_pipeline("wan")
    pd.apply_pisa(pipe, density=0.5, block_size=16, min_kv_len=0, dense_layers=0, dense_steps=0)
    seen, unwatch = _watch(pipe.transformer)
    path = tmp_path / "wan.safetensors"
    cap = capture_qkv(pipe, layers=1, path=path)
    pipe(**prompt_kwargs("wan"), num_inference_steps=2)  # two calls (cond, uncond) per step
    cap.close()
    unwatch()
    assert pd.pisa_state(pipe.transformer) is not None
    f = read_qkv_file(str(path))
    assert [e.name for e in f.entries] == ["step0.layer1", "step1.layer1"]
    for e in f.entries:
        assert torch.equal(e.q, seen[(e.step, 1)][0])
        assert e.info["dense"] is False and e.info["density"] == 0.5 and e.info["pisa_applied_by_capture"] is False
        assert e.layout.grid_shape == GRIDS["wan"] and e.layout.num_text_tokens == 0
    pd.remove_pisa(pipe)


def test_capture_errors(tmp_path):
    pipe = tiny_pipeline("flux")
    with pytest.raises(ValueError, match="layers"):
        capture_qkv(pipe, layers=[-1], path=tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="batch"):
        capture_qkv(pipe, batch=-1, path=tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="dtype"):
        capture_qkv(pipe, dtype=torch.int8, path=tmp_path / "x.safetensors")
    cap = capture_qkv(pipe, steps=[99], path=tmp_path / "x.safetensors")
    pipe(**prompt_kwargs("flux"), num_inference_steps=1)
    with pytest.raises(ValueError, match="recorded no attention call"):
        cap.close()
    assert pd.pisa_state(pipe.transformer) is None and not hooks.observers(pipe.transformer)
    with pytest.raises(ValueError, match="batch=3"):
        with capture_qkv(pipe, batch=3, path=tmp_path / "y.safetensors"):
            pipe(**prompt_kwargs("flux"), num_inference_steps=1)
    assert pd.pisa_state(pipe.transformer) is None and not hooks.observers(pipe.transformer)
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a pisa-attn"):
        read_qkv_file(str(tmp_path / "plain.safetensors"))
    with pytest.raises(TypeError, match="pipe"):
        capture_qkv(object(), path=tmp_path / "z.safetensors")


@pytest.mark.parametrize(
    "layout",
    [make_layout((3, 6, 10), tile=(2, 2, 4), text_after=8), make_layout((3, 6, 10), tile=(2, 2, 4), text_after=8,
     order="tiles"), make_layout((16, 16), text_before=16, order="tiles"), raster((4, 4), text_after=3),
     make_layout((3, 6, 10), tile=(2, 2, 4), text_after=8, order="compact_inplace"),
     make_layout((6, 10), tile=(4, 4), order="compact_inplace", offset=5)],
)
def test_layout_json_round_trip_and_trim(layout):
    assert layout_from_json(layout_to_json(layout)) == layout
    n = layout.num_tokens - 2
    cut = trim_layout(layout, n)
    if bool(layout.text_mask_tokens()[n:].all()):  # trailing text (padding) can be cut off
        assert cut is not None and cut.num_tokens == n
        assert torch.equal(cut.coords(tiled=True), layout.coords(tiled=True)[:n])
    else:  # compact order puts ragged-edge tiles after the text: no layout describes the prefix
        assert cut is None
    with pytest.raises(ValueError, match="malformed"):
        layout_from_json({"segments": [{"bogus": 1}]})


def test_calibrating_a_capture_at_another_block_size_is_refused(flux_capture):
    """The capture's tiles are the blocks its run saw: fitting them in blocks of another size would
    fit strips of tiles, not the tiles a run at that size uses."""
    from pisa_attn.bench.calibrate import calibrate_file

    path = flux_capture[3]
    tile = read_qkv_file(path).entries[0].layout.tile
    bs = math.prod(tile)
    with pytest.raises(ValueError, match=f"not blocks of block_size={bs // 2}: calibrate at block_size={bs}"):
        calibrate_file(path, density=0.25, block_size=bs // 2, rows=8)


def test_capture_counts_the_steps_of_an_expert_it_manages_with_the_users(tmp_path):
    """Wan2.2-like, the user manages one expert: the one capture manages shares its step count
    (steps 2 and 3 of four are the second expert's, not 0 and 1)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from diffusers_tiny import tiny_transformer

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=tiny_transformer("wan", 0), transformer_2=tiny_transformer("wan", 1),
                       boundary_ratio=0.5)
    pd.apply_pisa(pipe, density=1.0, dense_steps=100)
    pd.remove_pisa(pipe.transformer_2)
    path = tmp_path / "wan22.safetensors"
    with capture_qkv(pipe, layers=[0], path=path):
        with torch.no_grad():
            pipe(**prompt_kwargs("wan"), num_inference_steps=4)
    steps = {(e.name.startswith("transformer_2"), e.step) for e in read_qkv_file(path).entries}
    assert steps == {(False, 0), (False, 1), (True, 2), (True, 3)}, steps
    pd.remove_pisa(pipe)


def test_a_second_capture_is_refused_while_one_that_applied_pisa_is_open(tmp_path):
    """Closing the first would remove PISA from under the second (which would then record nothing);
    the model is left as it was: no empty observer list behind."""
    pipe = tiny_pipeline("flux")
    a = capture_qkv(pipe, path=tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="another capture_qkv is open"):
        capture_qkv(pipe, path=tmp_path / "b.safetensors")
    pipe(**prompt_kwargs("flux"), num_inference_steps=1)
    a.close()
    assert pd.pisa_state(pipe.transformer) is None and hooks.ATTR not in vars(pipe.transformer)
    b = capture_qkv(pipe, path=tmp_path / "b.safetensors")  # after the first closed: fine
    pipe(**prompt_kwargs("flux"), num_inference_steps=1)
    b.close()


def test_one_head_captures_are_copies(tmp_path):
    """SD3 with one head under CFG (batch 2): a row's [1, 1, L, D] slice is a contiguous view; stored
    as is, it kept the whole batch alive (max_bytes counted half) and aliased the model's tensor."""
    from diffusers_tiny import tiny_transformer

    tr = tiny_transformer("sd3", num_attention_heads=1, attention_head_dim=32)
    pipe = tiny_pipeline("sd3", transformer=tr)
    with capture_qkv(pipe, layers=[0], steps=[0], path=tmp_path / "c.safetensors") as cap:
        pipe(**prompt_kwargs("sd3"), num_inference_steps=1)
    assert cap.tensors
    for x in cap.tensors.values():
        assert x.untyped_storage().nbytes() == x.numel() * x.element_size()


def test_trim_layout_to_no_tokens_is_none_and_n_is_checked():
    """n = 0 gives None for every layout (a layout holds at least one segment: none describes an empty
    prefix; a text-only layout raised an error about segments); n must be a non-negative int."""
    import numpy as np

    from pisa_attn.layout import Text, TokenOrder

    text_only = TokenOrder((Text(5),), None, "raster")
    for layout in (text_only, raster((4, 4), text_after=3), make_layout((4, 4), tile=(2, 2), text_after=3)):
        assert trim_layout(layout, 0) is None
    assert trim_layout(text_only, np.int64(3)) == TokenOrder((Text(3),), None, "raster")
    assert trim_layout(text_only, 9) == text_only
    with pytest.raises(ValueError, match="n must be >= 0"):
        trim_layout(text_only, -1)  # would slice from the end
    with pytest.raises(TypeError, match="n must be an int"):
        trim_layout(text_only, 2.5)


def test_capture_arguments_take_numpy_ints(tmp_path):
    """layers, steps, batch and max_bytes take numpy integers (as PisaSettings and apply_pisa do);
    they were refused with messages calling np.int64(1) not an int."""
    import numpy as np

    pipe = tiny_pipeline("flux")
    path = tmp_path / "np.safetensors"
    with capture_qkv(pipe, layers=np.arange(2), steps=np.int64(0), path=path, batch=np.int64(0),
                     max_bytes=np.int64(10**9)) as cap:
        pipe(**prompt_kwargs("flux"), num_inference_steps=1)
    assert cap.names == ["step0.layer0", "step0.layer1"] and type(cap.batch) is int
    with pytest.raises(ValueError, match="layers"):
        capture_qkv(pipe, layers=np.int64(-1), path=path)
    with pytest.raises(TypeError, match="batch"):
        capture_qkv(pipe, batch=np.float32(0), path=path)
    assert pd.pisa_state(pipe.transformer) is None


def test_closing_a_capture_keeps_the_pisa_the_user_applied_while_it_was_open(tmp_path):
    """The capture applied PISA (density 1) and the user applied their own settings under it: close
    removed the user's PISA (the model then ran native attention), and the entries said the capture's
    dense PISA ran the calls that ran the user's sparse one."""
    pipe = tiny_pipeline("flux")
    cap = capture_qkv(pipe, layers=0, path=tmp_path / "u.safetensors")
    pipe(**prompt_kwargs("flux"), num_inference_steps=1)  # step 0 under the capture's own PISA
    pd.apply_pisa(pipe, density=0.5, block_size=16, min_kv_len=0, dense_layers=0, dense_steps=0)
    mine = pd.pisa_state(pipe.transformer)
    pipe(**prompt_kwargs("flux"), num_inference_steps=2)  # steps 0 (already recorded) and 1
    cap.close()
    assert pd.pisa_state(pipe.transformer) is mine and mine.config.density == 0.5
    info = {e.name: e.info for e in read_qkv_file(str(tmp_path / "u.safetensors")).entries}
    assert info["step0.layer0"]["pisa_applied_by_capture"] is True and info["step0.layer0"]["density"] == 1.0
    assert info["step1.layer0"]["pisa_applied_by_capture"] is False and info["step1.layer0"]["density"] == 0.5
    assert info["step1.layer0"]["dense"] is False
    pd.remove_pisa(pipe)


def test_a_failed_write_leaves_an_existing_capture_as_it_was(tmp_path, monkeypatch):
    # a capture is large: a write that fails part-way (a full disk) must not leave a truncated
    # file where the previous capture was
    import safetensors.torch

    from pisa_attn.qkv_file import write_qkv_file

    path = tmp_path / "c.safetensors"
    x = torch.randn(1, 2, 16, 16)
    tensors = {f"step0.layer0.{p}": x.clone() for p in "qkv"}
    write_qkv_file(str(path), tensors, {"step0.layer0": {"step": 0, "layer": 0}}, "flux", "float32")
    before = path.read_bytes()

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_qkv_file(str(path), tensors, {"step0.layer0": {"step": 0, "layer": 0}}, "flux", "float32")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]  # no temporary file left
    assert len(read_qkv_file(str(path)).entries) == 1
