"""apply_pisa on tiny FLUX / SD3 / Wan / HunyuanVideo transformers: equivalence, accuracy order,
tiling at the model boundary, text and mask handling, removal."""

import pytest
import torch

pytest.importorskip("diffusers")

import pisa_attn.diffusers as pd  # noqa: E402
from pisa_attn import pisa_attention  # noqa: E402
from diffusers_tiny import FAMILIES, GRIDS, TEXT_LEN, TILE_BLOCK, attention_layers, forward_inputs, tiny_transformer  # noqa: E402

SPARSE = dict(block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)


@pytest.fixture(scope="module")
def models():
    return {f: tiny_transformer(f) for f in FAMILIES}


def _run(tr, inputs):
    with torch.no_grad():
        return tr(**inputs).sample


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", FAMILIES)
def test_density_one_matches_native_and_remove_restores(models, family):
    tr, inputs = models[family], forward_inputs(family)
    native = _run(tr, inputs)
    pd.apply_pisa(tr, density=1.0, **SPARSE)
    try:
        out = _run(tr, inputs)
        assert pd.stats(tr) == {"sparse": attention_layers(family)}  # every layer went through PISA
    finally:
        pd.remove_pisa(tr)
    torch.testing.assert_close(out, native, rtol=1e-5, atol=1e-5)
    assert torch.equal(_run(tr, inputs), native)
    assert pd.pisa_state(tr) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_closer_to_dense_than_drop(models, family):
    tr, inputs = models[family], forward_inputs(family)
    dense = _run(tr, inputs)
    err = {}
    try:
        for mode in ("hybrid", "drop"):
            pd.apply_pisa(tr, density=0.25, mode=mode, **SPARSE)
            err[mode] = _rel(_run(tr, inputs), dense)
    finally:
        pd.remove_pisa(tr)
    assert 0 < err["hybrid"] < err["drop"]


# --- tiling at the model boundary ------------------------------------------------------------------
def _first_block_inputs(family, tr, inputs):
    """(hidden_states, rotary tensor or None, rotary token dim) entering the first block."""
    path = {"flux": "transformer_blocks.0", "sd3": "transformer_blocks.0", "wan": "blocks.0", "hunyuan": "transformer_blocks.0"}
    seen = {}

    def hook(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs

    h = tr.get_submodule(path[family]).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        _run(tr, inputs)
    finally:
        h.remove()
    a, kw = seen["args"], seen["kwargs"]
    if family == "flux":
        return kw["hidden_states"], kw["image_rotary_emb"][0][TEXT_LEN:], 0
    if family == "sd3":
        return kw["hidden_states"], None, None
    if family == "wan":
        return a[0], a[3][0], 1
    return a[0], a[4][0], 0


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_see_tiled_tokens_and_rotary(models, family):
    tr, inputs = models[family], forward_inputs(family)
    x0, rope0, dim = _first_block_inputs(family, tr, inputs)
    pd.apply_pisa(tr, density=0.5, **SPARSE)
    try:
        x1, rope1, _ = _first_block_inputs(family, tr, inputs)
        (layouts,) = pd.pisa_state(tr).layouts.values()
    finally:
        pd.remove_pisa(tr)
    image = layouts.image
    assert image.grid_shape == GRIDS[family] and not image.is_identity
    assert torch.equal(x1, image.to_tiled(x0, 1))
    assert not torch.equal(x1, x0)
    if rope0 is not None:
        assert torch.equal(rope1, image.to_tiled(rope0, dim))


def _observe(tr, inputs):
    calls = []
    remove = pd.hooks.add_observer(tr, calls.append)
    try:
        _run(tr, inputs)
    finally:
        remove()
    return calls


def test_flux_text_queries_dense_text_keys_kept(models):
    tr, inputs = models["flux"], forward_inputs("flux")
    pd.apply_pisa(tr, density=0.25, covariance_aware=True, **SPARSE)
    try:
        calls = _observe(tr, inputs)
    finally:
        pd.remove_pisa(tr)
    assert [c.layer for c in calls] == [0, 1, 2, 3] and not any(c.dense for c in calls)
    n_img = GRIDS["flux"][0] * GRIDS["flux"][1]
    for c in calls:
        assert c.model == "flux" and c.q.shape[2] == TEXT_LEN + n_img
        assert c.meta["text_len"] == TEXT_LEN and c.meta["grid"] == GRIDS["flux"]
        assert c.meta["image_range"] == (TEXT_LEN, TEXT_LEN + n_img)
        layout = c.meta["token_layout"]
        assert layout.num_tokens == TEXT_LEN + n_img
        assert layout.text_mask_tokens()[:TEXT_LEN].all() and not layout.text_mask_tokens()[TEXT_LEN:].any()
        assert c.keep_blocks[0] and not c.keep_blocks[1:].any()  # the text block is always exact
        text_out = torch.nn.functional.scaled_dot_product_attention(c.q[:, :, :TEXT_LEN], c.k, c.v)
        torch.testing.assert_close(c.out[:, :, :TEXT_LEN], text_out, rtol=1e-5, atol=1e-6)
        img_out = pisa_attention(
            c.q[:, :, TEXT_LEN:], c.k, c.v, density=0.25, block_size=TILE_BLOCK, mode="hybrid",
            covariance_aware=True, keep_blocks=c.keep_blocks,
        )
        torch.testing.assert_close(c.out[:, :, TEXT_LEN:], img_out, rtol=1e-5, atol=1e-6)


def test_sd3_text_after_image_and_image_only_attn2(models):
    tr, inputs = models["sd3"], forward_inputs("sd3", batch=2)
    pd.apply_pisa(tr, density=0.25, **SPARSE)
    try:
        calls = _observe(tr, inputs)
    finally:
        pd.remove_pisa(tr)
    n_img = GRIDS["sd3"][0] * GRIDS["sd3"][1]
    lengths = [c.q.shape[2] for c in calls]
    assert lengths == [n_img + 8, n_img, n_img + 8]  # block 0: joint attn, then image-only attn2
    joint, image_only = calls[0], calls[1]
    assert joint.meta["image_range"] == (0, n_img) and joint.meta["text_len"] == 8 and joint.keep_blocks[-1]
    assert image_only.meta["text_len"] == 0 and image_only.keep_blocks is None
    assert joint.q.shape[0] == 2


def test_hunyuan_padded_text_keys_masked(models):
    tr = models["hunyuan"]
    inputs = forward_inputs("hunyuan")
    other = dict(inputs)
    ehs = inputs["encoder_hidden_states"].clone()
    ehs[:, 5:] = torch.randn_like(ehs[:, 5:]) * 10  # garbage in the 3 padded text positions
    other["encoder_hidden_states"] = ehs
    pd.apply_pisa(tr, density=0.25, **SPARSE)
    try:
        calls = _observe(tr, inputs)
        a, b = _run(tr, inputs), _run(tr, other)
    finally:
        pd.remove_pisa(tr)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # padded text never reaches the image tokens
    n = calls[0].q.shape[2]
    for c in calls:
        assert c.meta["key_lens"] == [n - 3]
        keep = c.keep_blocks[: -(-(n - 3) // TILE_BLOCK)]
        img = pisa_attention(
            c.q[:, :, : n - 8], c.k[:, :, : n - 3], c.v[:, :, : n - 3], density=0.25, block_size=TILE_BLOCK,
            keep_blocks=keep, covariance_aware=c.covariance_aware,
        )
        torch.testing.assert_close(c.out[:, :, : n - 8], img, rtol=1e-5, atol=1e-6)


def test_hunyuan_rows_with_different_text_lengths(models):
    tr = models["hunyuan"]
    inputs = forward_inputs("hunyuan", batch=2)
    inputs["encoder_attention_mask"][1, :7] = 1  # row 0: 5 valid text tokens, row 1: 7
    single = []
    pd.apply_pisa(tr, density=0.25, **SPARSE)
    try:
        both = _run(tr, inputs)
        for row in range(2):
            one = {k: (v[row : row + 1] if torch.is_tensor(v) and v.dim() and v.shape[0] == 2 else v) for k, v in inputs.items()}
            single.append(_run(tr, one))
    finally:
        pd.remove_pisa(tr)
    torch.testing.assert_close(both, torch.cat(single), rtol=1e-5, atol=1e-5)


def test_flux_rejects_non_raster_ids(models):
    tr, inputs = models["flux"], forward_inputs("flux")
    inputs["img_ids"] = inputs["img_ids"].flip(0)
    pd.apply_pisa(tr, density=0.5, **SPARSE)
    try:
        with pytest.raises(ValueError, match="img_ids"):
            _run(tr, inputs)
        assert pd.pisa_state(tr).runs == []  # the failed call left no open run
    finally:
        pd.remove_pisa(tr)


def test_flux_ids_written_in_place_are_read_again():
    """A loop that reuses one img_ids buffer and writes another grid of the same token count into
    it gets the new grid, not the one read before."""
    from pisa_attn.diffusers.models import _IdsGrid

    def ids(h, w):
        y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        return torch.stack([torch.zeros(h * w), y.flatten().float(), x.flatten().float()], -1)

    read, buf = _IdsGrid(), ids(4, 16)
    assert read(buf) == (4, 16) and read(buf) == (4, 16)
    buf.copy_(ids(16, 4))
    assert read(buf) == (16, 4)


def test_hunyuan_token_replace_rejected():
    tr = tiny_transformer("hunyuan", image_condition_type="token_replace")
    with pytest.raises(ValueError, match="token_replace"):
        pd.apply_pisa(tr)
    assert pd.pisa_state(tr) is None


def test_defaults_follow_appendix_d(models):
    from diffusers_tiny import tiny_transformer as tt

    expect = {"flux": (4, 0, True), "sd3": (4, 0, True), "wan": (1, 15, False), "hunyuan": (1, 10, False)}
    for family, (layers, steps, cov) in expect.items():
        tr = models[family]
        pd.apply_pisa(tr)
        try:
            cfg = pd.pisa_state(tr).config
        finally:
            pd.remove_pisa(tr)
        assert (cfg.schedule.dense_layers, cfg.schedule.dense_steps, cfg.covariance_aware) == (layers, steps, cov)
        assert cfg.density == 0.15 and cfg.mode == "hybrid" and cfg.block_size == 64
    wan14b = pd.adapter_for(models["wan"]).defaults(type("C", (), {"num_attention_heads": 40, "attention_head_dim": 128}))
    wan13b = pd.adapter_for(models["wan"]).defaults(type("C", (), {"num_attention_heads": 12, "attention_head_dim": 128}))
    assert wan14b["dense_steps"] == 10 and wan13b["dense_steps"] == 15
    del tt


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(density=0.0), ValueError, "density"),
        (dict(density="0.1"), TypeError, "density"),
        (dict(mode="fast"), ValueError, "mode"),
        (dict(block_size=48), ValueError, "block_size"),
        (dict(tile=(8, 8, 8)), ValueError, "tile"),
        (dict(dense_layers=-1), ValueError, "dense_layers"),
        (dict(dense_steps=1.5), TypeError, "dense_steps"),
        (dict(covariance_aware="yes"), TypeError, "covariance_aware"),
        (dict(min_kv_len=-3), ValueError, "min_kv_len"),
    ],
)
def test_bad_arguments(models, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pd.apply_pisa(models["flux"], **kwargs)
    assert pd.pisa_state(models["flux"]) is None


def test_numpy_numbers_are_taken_as_by_pisa_settings(models):
    np = pytest.importorskip("numpy")
    pd.apply_pisa(models["flux"], density=np.float64(0.2), dense_layers=np.int64(1), dense_steps=np.int32(2),
                  min_kv_len=np.int64(0), covariance_aware=np.bool_(False), tile=(np.int64(8), np.int32(8)))
    cfg = pd.pisa_state(models["flux"]).config
    assert cfg.tile == (8, 8) and all(type(t) is int for t in cfg.tile)
    assert type(cfg.schedule.dense_steps) is int and cfg.schedule.dense_steps == 2
    assert cfg.schedule.dense_layers == 1 and cfg.schedule.min_kv_len == 0 and cfg.covariance_aware is False
    pd.remove_pisa(models["flux"])
    with pytest.raises(TypeError, match="dense_steps"):
        pd.apply_pisa(models["flux"], dense_steps=np.bool_(True))


def test_unsupported_object():
    with pytest.raises(TypeError, match="no adapter"):
        pd.apply_pisa(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="pipe_or_transformer"):
        pd.apply_pisa(object())


def test_apply_twice_replaces_settings(models):
    tr, inputs = models["wan"], forward_inputs("wan")
    pd.apply_pisa(tr, density=0.5, **SPARSE)
    pd.apply_pisa(tr, density=0.25, **SPARSE)
    try:
        assert pd.pisa_state(tr).config.density == 0.25
        assert len(pd.pisa_state(tr).restore) == 2 + 5  # not doubled: 2 processors, 5 hooks
        calls = _observe(tr, inputs)
        assert all(c.density == 0.25 for c in calls)
    finally:
        pd.remove_pisa(tr)
    native = tiny_transformer("wan")
    torch.testing.assert_close(_run(tr, inputs), _run(native, inputs), rtol=0, atol=0)


def test_wan_per_token_timesteps_are_tiled(models):
    # Wan2.2 TI2V passes one timestep per video token ([B, L]); they must follow the tokens.
    tr, inputs = models["wan"], forward_inputs("wan")
    f, h, w = GRIDS["wan"]
    inputs["timestep"] = torch.linspace(100, 900, f * h * w)[None]
    native = _run(tr, inputs)
    pd.apply_pisa(tr, density=1.0, **SPARSE)
    try:
        out = _run(tr, inputs)
    finally:
        pd.remove_pisa(tr)
    torch.testing.assert_close(out, native, rtol=1e-5, atol=1e-5)


def test_telemetry_attached_and_detached(models):
    from pisa_attn.diffusers import telemetry

    tr, inputs = models["wan"], forward_inputs("wan")
    pd.apply_pisa(tr, density=0.5, telemetry=True, **SPARSE)
    try:
        tel = telemetry.get(tr)
        assert tel is not None and tel.active and len(pd.hooks.observers(tr)) == 1
        _run(tr, inputs)
        assert len(tel.records) > 0
    finally:
        pd.remove_pisa(tr)
    assert not tel.active and pd.hooks.observers(tr) == []


def test_settings_reach_the_sparse_calls_and_plans_are_shared(models):
    # One PisaSettings per transformer: query_block reaches the calls (a coarser selection changes
    # the output), numpy scalars are accepted, and layers of one shape share one plan.
    import numpy as np

    tr, inputs = models["wan"], forward_inputs("wan")
    outs = {}
    for qb in (None, 2 * TILE_BLOCK):
        pd.apply_pisa(tr, **{**SPARSE, "density": np.float32(0.25), "block_size": np.int64(TILE_BLOCK)},
                      query_block=qb)
        try:
            state = pd.pisa_state(tr)
            assert state.config.settings.query_block == qb and state.config.settings.layout == "bshd"
            outs[qb] = _run(tr, inputs)
            assert pd.stats(tr) == {"sparse": 2} and len(state.plans) == 1  # two layers, one plan
        finally:
            pd.remove_pisa(tr)
    assert not torch.equal(outs[None], outs[2 * TILE_BLOCK])
