"""The "pisa" backend under diffusers context parallelism, 2 gloo CPU ranks, tiny FLUX and Wan:
Ulysses and ring outputs equal the single-process PISA output; the benchmark runs at tiny size.

One spawn runs everything (process start and the diffusers import dominate); cases assert apart.
Tolerances: the outputs are float32; a different block selection moves them by about the PISA vs
dense difference (checked to be >= 1e-3 here), far above the 2e-5 allowed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from local_ranks import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "benchmarks", "bench_parallel.py")
SETTINGS = dict(density=0.3, dense_layers=1, dense_steps=0, block_size=16, min_kv_len=0, covariance_aware=True)
TOL = 2e-5


def _config(kind: str, world: int, anything: bool = False):
    from diffusers import ContextParallelConfig

    extra = {f"{kind}_anything": True} if anything else {}
    return ContextParallelConfig(**{f"{kind}_degree": world}, **extra)


def uneven_inputs(family: str) -> dict:
    """Token streams no even split handles: FLUX with 15 text tokens, Wan on a 3x5x9 latent grid
    (135 tokens)."""
    import diffusers_tiny as dt

    inputs = dict(dt.forward_inputs(family), return_dict=False)
    if family == "flux":
        inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"][:, :15]
        inputs["txt_ids"] = inputs["txt_ids"][:15]
    else:
        inputs["hidden_states"] = inputs["hidden_states"][:, :, :, :10, :18]
    return inputs


def cp_results(family: str, runs, heads: int = 2) -> dict:
    """Max |CP - one process| per run (name, config, pisa_first, uneven) and the stats counters."""
    import diffusers_tiny as dt

    from pisa_attn.diffusers import apply_pisa, stats

    kw = {} if heads == 2 else dict(num_attention_heads=heads)
    # A different first-order weight per head: Ulysses must hand each rank its own heads' weights.
    settings = {**SETTINGS, "alpha": torch.linspace(0.2, 1.0, heads, dtype=torch.float64)}
    res, want = {}, {}
    with torch.no_grad():
        for uneven in sorted({r[3] for r in runs}):
            inputs = uneven_inputs(family) if uneven else dict(dt.forward_inputs(family), return_dict=False)
            single = apply_pisa(dt.tiny_transformer(family, **kw), **settings)
            want[uneven] = (inputs, single(**inputs)[0], stats(single))
            if not uneven:
                dense = dt.tiny_transformer(family, **kw)(**inputs)[0]
                res["pisa_vs_dense"] = float((want[uneven][1] - dense).abs().max())
        res["single_stats"] = want[False][2] if False in want else want[True][2]
        for name, config, pisa_first, uneven in runs:
            inputs, ref, ref_stats = want[uneven]
            model = dt.tiny_transformer(family, **kw)
            if pisa_first:
                apply_pisa(model, **settings)
            model.enable_parallelism(config=config)
            if not pisa_first:
                apply_pisa(model, **settings)
            got = model(**inputs)[0]
            res[name] = (float((got - ref).abs().max()), stats(model) == ref_stats, stats(model))
    return res


def _family_results(family: str, world: int) -> dict:
    runs = [
        ("ulysses", _config("ulysses", world), True, False),  # both orders of the two calls
        ("ring", _config("ring", world), False, False),
        ("ring-uneven", _config("ring", world, anything=True), True, True),
        ("ulysses-uneven", _config("ulysses", world, anything=True), True, True),
    ]
    return cp_results(family, runs)


def _uneven_refused(world: int) -> dict:
    """Without *_anything, a length diffusers cannot split evenly is refused before diffusers
    shards anything, with the fix in the message; the model is unchanged and runs afterwards."""
    import diffusers_tiny as dt

    from pisa_attn.diffusers import apply_pisa

    out = {}
    with torch.no_grad():
        for family in ("flux", "wan"):
            model = apply_pisa(dt.tiny_transformer(family), **SETTINGS)
            model.enable_parallelism(config=_config("ring", world))
            try:
                model(**uneven_inputs(family))
                out[family] = "no error"
            except ValueError as e:
                out[family] = str(e)
            even = dict(dt.forward_inputs(family), return_dict=False)
            out[family + "-after"] = bool(torch.isfinite(model(**even)[0]).all())
    return out


def _errors(world: int) -> dict:
    import diffusers_tiny as dt

    from pisa_attn.diffusers import apply_pisa, hooks

    inputs = dict(dt.forward_inputs("wan"), return_dict=False)
    out = {}
    with torch.no_grad():
        watched = apply_pisa(dt.tiny_transformer("wan"), **SETTINGS)
        hooks.add_observer(watched, lambda call: None)
        watched.enable_parallelism(config=_config("ring", world))
        # A managed attention module called outside its transformer's forward.
        alone = apply_pisa(dt.tiny_transformer("wan"), **SETTINGS)
        alone.enable_parallelism(config=_config("ulysses", world))
        x = torch.randn(1, 8, alone.config.num_attention_heads * alone.config.attention_head_dim)
        for name, call in (("observers", lambda: watched(**inputs)), ("outside", lambda: alone.blocks[1].attn1(x))):
            try:
                call()
                out[name] = "no error"
            except ValueError as e:
                out[name] = str(e)
    return out


def _bench(rank: int, world: int):
    spec = importlib.util.spec_from_file_location("bench_parallel", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.parse_args(["--tiny", "--dense", "--kinds", "ulysses,ring", "--iters", "1", "--warmup", "0",
                           "--out", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_parallel_{os.getpid()}")])
    res = mod.bench_rank(rank, world, args)
    return None if res is None else (res, mod.table(res))


def _worker(rank, world):
    sys.path.insert(0, HERE)  # diffusers_tiny
    from cpu_context_parallel import allow_cpu_context_parallel

    allow_cpu_context_parallel()
    return {
        "flux": _family_results("flux", world),
        "wan": _family_results("wan", world),
        "errors": _errors(world),
        "refused": _uneven_refused(world),
        "bench": _bench(rank, world),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, 2)


def check_equal(results, family: str, kind: str, dense_calls: int = 1):
    for res in results:
        fam = res[family]
        err, same_stats, got_stats = fam[kind]
        assert fam["pisa_vs_dense"] > 1e-3  # the tiny models really run sparse: a wrong selection would show
        assert err < TOL, (family, kind, err)
        assert same_stats and got_stats["sparse"] > 0 and got_stats["dense"] == dense_calls, got_stats


@pytest.mark.parametrize("family", ["flux", "wan"])
@pytest.mark.parametrize("kind", ["ulysses", "ring", "ring-uneven", "ulysses-uneven"])
def test_context_parallel_equals_single_process(ranks, family, kind):
    check_equal(ranks, family, kind)


def test_uneven_split_without_anything_mode_names_the_fix(ranks):
    for res in ranks:
        for family in ("flux", "wan"):
            msg = res["refused"][family]
            assert "not divisible by 2" in msg and "ring_anything=True" in msg, msg
            assert res["refused"][family + "-after"]


def test_clear_errors(ranks):
    for res in ranks:
        assert "inside its transformer's forward" in res["errors"]["outside"]
        assert "observers" in res["errors"]["observers"]


def test_bench_tiny(ranks):
    """The benchmark's rows, differences against 1-rank PISA, phase split and table (tiny, CPU)."""
    res, text = ranks[0]["bench"]
    assert ranks[1]["bench"] is None
    (shape,) = res["shapes"]
    configs = ["dense 1 GPU", "pisa 1 GPU", "pisa ulysses x2", "pisa ring x2", "dense ulysses x2"]
    assert [r["config"] for r in shape["rows"]] == configs and not shape["skipped"]
    for row in shape["rows"][2:]:
        assert row["max_abs_diff"] < TOL and row["finite"] and row["speedup"] > 0
    ring = shape["rows"][3]["phases_ms"]
    assert ring["calls"] > 0 and all(ring[k] > 0 for k in ("attend", "wait", "merge", "stats", "select"))
    assert "a2a" in shape["rows"][2]["phases_ms"]
    assert shape["pisa_vs_dense_1gpu_max_abs"] > 1e-3
    split = shape["kernel_split"]
    assert split["shards"] == 2 and min(split["attend_one_ms"], split["attend_shards_ms"], split["merge_ms"]) > 0
    assert "kernel split" in text
    assert text.splitlines()[-1].lstrip().startswith("dense ulysses x2")


def test_masks_rejected():
    from pisa_attn.diffusers.parallel import parallel_attention

    x = torch.zeros(1, 8, 2, 16)
    ring = SimpleNamespace(context_parallel_config=SimpleNamespace(ring_degree=2, ulysses_degree=1))
    with pytest.raises(ValueError, match="attention masks"):
        parallel_attention(None, 0, x, x, x, torch.ones(1, 8, dtype=torch.bool), ring)


def test_token_split_check_names_the_fix_for_unified():
    """Ulysses x ring: diffusers has no uneven split at all, so the message names the alternatives."""
    from pisa_attn.diffusers.parallel import check_token_split
    from pisa_attn.diffusers.tiling import build_layouts

    seq = build_layouts((6, 8), 13, "before", (4, 4), 16).joint  # 13 text + 48 image tokens
    cp = SimpleNamespace(ring_degree=2, ulysses_degree=2, ulysses_anything=False, ring_anything=False)
    model = SimpleNamespace(_parallel_config=SimpleNamespace(context_parallel_config=cp))
    with pytest.raises(ValueError, match=r"13 text tokens \(not divisible by 4\).*ring_anything=True"):
        check_token_split(model, seq)
    cp.ring_degree = 1
    with pytest.raises(ValueError, match=r"ulysses_degree=2, ulysses_anything=True"):
        check_token_split(model, seq)
    cp.ulysses_anything = True
    check_token_split(model, seq)  # tensor_split: any length


def test_pisa_order_maps_rank_major_gather_to_tiled_sequence():
    """FLUX-like: ranks hold [text_r, image_r]; the order must rebuild [text][tiled image]."""
    from pisa_attn.diffusers.parallel import pisa_order
    from pisa_attn.diffusers.tiling import build_layouts

    seq = build_layouts((6, 8), 12, "before", (4, 4), 16).joint
    model = torch.arange(seq.length)  # token ids in model order
    text, image = model[:12], model[12:]
    gathered = torch.cat([torch.cat([t, i]) for t, i in zip(text.chunk(2), image.chunk(2))])
    perm = pisa_order(seq, (30, 30))
    assert torch.equal(gathered[perm], model[seq.layout.perm])
    with pytest.raises(ValueError, match="split evenly"):
        pisa_order(seq, (28, 32))


def test_managed_sequence_gathers_when_a_rank_cannot_tell_the_sequences_apart():
    """14 image tokens and one text token on two ranks: rank 1 holds no text, so its shares of the
    joint sequence (8 + 7) and of the image-only one (7 + 7) have one length. Every rank then
    gathers (none picks alone); with text on every rank the lengths tell them apart."""
    from pisa_attn.diffusers.parallel import _managed_sequence
    from pisa_attn.diffusers.tiling import build_layouts

    run = SimpleNamespace(layouts=build_layouts((2, 7), 1, "before", (1, 4), 4))
    for rank, local in ((0, 8), (0, 7), (1, 7)):
        assert _managed_sequence(run, local, rank, 2) == (None, None), (rank, local)
    lay = build_layouts((2, 7), 2, "before", (1, 4), 4)
    run = SimpleNamespace(layouts=lay)
    for rank in (0, 1):
        assert _managed_sequence(run, 7, rank, 2) == (lay.image_only, (7, 7))
        assert _managed_sequence(run, 8, rank, 2) == (lay.joint, (8, 8))


def test_observers_under_context_parallelism_are_refused_by_apply():
    """calibrate=True and telemetry cannot run under context parallelism: apply_pisa says so when the
    transformer is already parallel (not at the first attention call) and leaves it as it was."""
    import pisa_attn.diffusers as pd
    from diffusers_tiny import TILE_BLOCK, tiny_transformer

    tr = tiny_transformer("wan")
    cp = SimpleNamespace(ring_degree=2, ulysses_degree=1)
    tr._parallel_config = SimpleNamespace(context_parallel_config=cp, tensor_parallel_config=None)
    run = dict(density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=1)
    for extra in (dict(calibrate=True), dict(telemetry=True)):
        with pytest.raises(ValueError, match="context parallelism"):
            pd.apply_pisa(tr, **run, **extra)
        assert pd.pisa_state(tr) is None
    pd.apply_pisa(tr, **run)
    pd.remove_pisa(tr)
    tr._parallel_config = None
