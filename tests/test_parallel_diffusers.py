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

from pisa_attn.parallel.launch import run_local

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "benchmarks", "bench_parallel.py")
SETTINGS = dict(density=0.3, dense_layers=1, dense_steps=0, block_size=16, min_kv_len=0, covariance_aware=True)
TOL = 2e-5


def _config(kind: str, world: int):
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(**{f"{kind}_degree": world})


def _family_results(family: str, world: int) -> dict:
    import diffusers_tiny as dt

    from pisa_attn.diffusers import apply_pisa, stats

    inputs = dict(dt.forward_inputs(family), return_dict=False)
    res = {}
    with torch.no_grad():
        single = apply_pisa(dt.tiny_transformer(family), **SETTINGS)
        want = single(**inputs)[0]
        res["single_stats"] = stats(single)
        res["pisa_vs_dense"] = float((want - dt.tiny_transformer(family)(**inputs)[0]).abs().max())
        for kind, pisa_first in (("ulysses", True), ("ring", False)):  # both orders of the two calls
            model = dt.tiny_transformer(family)
            if pisa_first:
                apply_pisa(model, **SETTINGS)
            model.enable_parallelism(config=_config(kind, world))
            if not pisa_first:
                apply_pisa(model, **SETTINGS)
            got = model(**inputs)[0]
            res[kind] = (float((got - want).abs().max()), stats(model))
    return res


def _errors(world: int) -> dict:
    import diffusers_tiny as dt

    from pisa_attn.diffusers import apply_pisa, hooks

    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    inputs = dict(dt.forward_inputs("wan"), return_dict=False)
    out = {}
    active = registry._active_backend  # set_attention_backend also changes the process-wide default
    with torch.no_grad():
        plain = dt.tiny_transformer("wan")
        plain.set_attention_backend("pisa")
        registry.set_active_backend(active)
        plain.enable_parallelism(config=_config("ulysses", world))
        watched = apply_pisa(dt.tiny_transformer("wan"), **SETTINGS)
        hooks.add_observer(watched, lambda call: None)
        watched.enable_parallelism(config=_config("ring", world))
        for name, model in (("no-apply", plain), ("observers", watched)):
            try:
                model(**inputs)
                out[name] = "no error"
            except ValueError as e:
                out[name] = str(e)
    return out


def _bench(rank: int, world: int):
    spec = importlib.util.spec_from_file_location("bench_parallel", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.parse_args(["--tiny", "--kinds", "ulysses", "--iters", "1", "--warmup", "0"])  # ring: above
    res = mod.bench_rank(rank, world, args)
    return None if res is None else (res, mod.table(res))


def _worker(rank, world):
    sys.path.insert(0, HERE)  # diffusers_tiny
    from pisa_attn.diffusers.parallel import allow_cpu_context_parallel

    allow_cpu_context_parallel()
    return {
        "flux": _family_results("flux", world),
        "wan": _family_results("wan", world),
        "errors": _errors(world),
        "bench": _bench(rank, world),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_local(_worker, 2)


@pytest.mark.parametrize("family", ["flux", "wan"])
@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_context_parallel_equals_single_process(ranks, family, kind):
    for res in ranks:
        fam = res[family]
        err, stats = fam[kind]
        assert fam["pisa_vs_dense"] > 1e-3  # the tiny models really run sparse: a wrong selection would show
        assert err < TOL, (family, kind, err)
        assert stats == fam["single_stats"] and stats["sparse"] > 0 and stats["dense"] == 1


def test_clear_errors(ranks):
    for res in ranks:
        assert "needs apply_pisa" in res["errors"]["no-apply"]
        assert "observers" in res["errors"]["observers"]


def test_bench_tiny(ranks):
    res, text = ranks[0]["bench"]
    assert ranks[1]["bench"] is None
    configs = ["dense 1 rank", "pisa 1 rank", "dense ulysses x2", "pisa ulysses x2"]
    assert [r["config"] for r in res["rows"]] == configs
    for row in res["rows"][2:]:
        assert row["max_abs_diff"] < TOL and row["finite"] and row["speedup"] > 0
    assert res["pisa_vs_dense_1rank"] > 1e-3
    assert text.splitlines()[-1].startswith("pisa ulysses x2")


def test_unified_and_masks_rejected():
    from pisa_attn.diffusers.parallel import parallel_attention

    x = torch.zeros(1, 8, 2, 16)
    both = SimpleNamespace(context_parallel_config=SimpleNamespace(ring_degree=2, ulysses_degree=2))
    with pytest.raises(ValueError, match="not both"):
        parallel_attention(x, x, x, None, None, False, both)
    ring = SimpleNamespace(context_parallel_config=SimpleNamespace(ring_degree=2, ulysses_degree=1))
    with pytest.raises(ValueError, match="attention masks"):
        parallel_attention(x, x, x, torch.ones(1, 8, dtype=torch.bool), None, False, ring)


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
