"""Warm-up schedule and step tracking: unit tests, and counters over full tiny pipelines."""

from collections import Counter

import pytest
import torch

from pisa_attn.diffusers.schedule import DEFAULT_MIN_KV_LEN, Schedule, StepTracker

pytest.importorskip("diffusers")

import pisa_attn.diffusers as pd  # noqa: E402
from diffusers_tiny import FAMILIES, TILE_BLOCK, attention_layers, forward_inputs, prompt_kwargs, tiny_pipeline  # noqa: E402

# Transformer calls per denoising step: Wan runs cond and uncond separately, SD3 batches CFG.
CALLS_PER_STEP = {"flux": 1, "sd3": 1, "wan": 2, "hunyuan": 1}
STEPS = 3


def test_schedule_reasons():
    s = Schedule(dense_layers=2, dense_steps=3, min_kv_len=100)
    assert s.dense_reason(layer=5, step=0, kv_len=1000) == "warmup_step"
    assert s.dense_reason(layer=1, step=3, kv_len=1000) == "warmup_layer"
    assert s.dense_reason(layer=2, step=3, kv_len=99) == "few_tokens"
    assert s.dense_reason(layer=2, step=3, kv_len=100) is None
    n = DEFAULT_MIN_KV_LEN
    assert Schedule().dense_reason(0, 0, n) is None and Schedule().dense_reason(0, 0, n - 1) == "few_tokens"
    with pytest.raises(ValueError, match="dense_layers"):
        Schedule(dense_layers=-1)
    with pytest.raises(TypeError, match="dense_steps"):
        Schedule(dense_steps=True)


def test_step_tracker():
    tr = StepTracker()
    # Two calls per step (Wan cond/uncond), then a new generation (timestep goes back up).
    seen = [tr.observe(t) for t in (1.0, 1.0, 0.6, 0.6, 0.2, 0.2, 1.0, 0.5)]
    assert seen == [0, 0, 1, 1, 2, 2, 0, 1]
    tr.observe(0.3)
    tr.reset()
    assert tr.observe(0.3) == 0  # explicit reset: same timestep starts over
    with pytest.raises(ValueError, match="timestep"):
        tr.observe(float("nan"))


def _generate(pipe, family, steps=STEPS, seed=0):
    with torch.no_grad():
        out = pipe(**prompt_kwargs(family, seed), num_inference_steps=steps)
    return out[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_warmup_counts(family):
    pipe = tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    tr = pipe.transformer
    pd.apply_pisa(pipe, density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=1, dense_steps=1)
    calls = []
    remove = pd.hooks.add_observer(tr, lambda c: calls.append((c.step, c.layer, c.dense, c.meta["block"])))
    try:
        for generation in range(2):  # the second generation starts again at step 0
            calls.clear()
            _generate(pipe, family)
            n_layers = attention_layers(family)
            per_step = CALLS_PER_STEP[family] * n_layers
            assert len(calls) == STEPS * per_step
            assert Counter(s for s, _, _, _ in calls) == {s: per_step for s in range(STEPS)}
            assert all(layer < n_layers for _, layer, _, _ in calls)
            for step, layer, dense, block in calls:
                assert dense == (step < 1 or block < 1), (generation, step, layer)
            dense_steps = {s for s in range(STEPS) if all(d for st, _, d, _ in calls if st == s)}
            dense_layers = {l for l in range(n_layers) if all(d for _, la, d, _ in calls if la == l)}
            # dense_layers=1 is the first transformer block: SD3.5's attn and attn2 of block 0
            assert dense_steps == {0} and dense_layers == ({0, 1} if family == "sd3" else {0})
            n_dense = per_step + (STEPS - 1) * CALLS_PER_STEP[family] * len(dense_layers)
            assert pd.stats(tr) == {
                "dense": n_dense,
                "sparse": STEPS * per_step - n_dense,
                "warmup_step": per_step,
                "warmup_layer": (STEPS - 1) * CALLS_PER_STEP[family] * len(dense_layers),
            }
    finally:
        remove()
        pd.remove_pisa(pipe)
    assert "progress_bar" not in pipe.__dict__


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_output_close_to_dense_and_restored(family):
    pipe = tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    dense = _generate(pipe, family)
    pd.apply_pisa(pipe, density=1.0, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)
    full = _generate(pipe, family)
    errs = {}
    for mode in ("hybrid", "drop"):
        pd.apply_pisa(pipe, density=0.25, mode=mode, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)
        errs[mode] = float((_generate(pipe, family) - dense).norm() / dense.norm())
    pd.remove_pisa(pipe)
    torch.testing.assert_close(full, dense, rtol=1e-4, atol=1e-4)
    assert 0 < errs["hybrid"] < errs["drop"]
    assert torch.equal(_generate(pipe, family), dense)


def test_transformer_only_tracks_steps_from_timesteps():
    pipe = tiny_pipeline("wan")
    tr = pipe.transformer
    pd.apply_pisa(tr, density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=2)
    steps = []
    remove = pd.hooks.add_observer(tr, lambda c: steps.append(c.step) if c.layer == 0 else None)
    try:
        with torch.no_grad():
            for t in (0.9, 0.9, 0.6, 0.3, 0.9):
                tr(**forward_inputs("wan", timestep=t))
        assert steps == [0, 0, 1, 2, 0]
        assert pd.stats(tr) == {"dense": 2, "warmup_step": 2}  # stats restart with the new generation
    finally:
        remove()
        pd.remove_pisa(tr)


def test_two_transformers_share_one_step_count():
    # Wan2.2-style pipelines switch from `transformer` to `transformer_2` mid-generation.
    from diffusers_tiny import tiny_transformer

    pipe = tiny_pipeline("wan")
    pipe.transformer_2 = tiny_transformer("wan", seed=1)
    pd.apply_pisa(pipe, density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)
    try:
        s1, s2 = pd.pisa_state(pipe.transformer), pd.pisa_state(pipe.transformer_2)
        assert s1.tracker is s2.tracker
        steps = []
        pd.hooks.add_observer(pipe.transformer_2, lambda c: steps.append(c.step))
        with torch.no_grad():
            pipe.transformer(**forward_inputs("wan", timestep=0.9))
            pipe.transformer_2(**forward_inputs("wan", timestep=0.5))
            assert steps == [1, 1]
            assert pd.stats(pipe.transformer) == pd.stats(pipe.transformer_2) == {"sparse": 2}
            # A new generation, seen first by transformer: transformer_2's counts restart too.
            pipe.transformer(**forward_inputs("wan", timestep=0.9))
            pipe.transformer_2(**forward_inputs("wan", timestep=0.4))
        assert steps == [1, 1, 1, 1]
        assert pd.stats(pipe.transformer) == pd.stats(pipe.transformer_2) == {"sparse": 2}
    finally:
        pd.remove_pisa(pipe)
    assert pd.pisa_state(pipe.transformer_2) is None


def test_sd35_dense_layers_count_transformer_blocks():
    # SD3.5-medium runs attn and attn2 in its first blocks: dense_layers counts blocks (the paper's
    # "4 dense layers"), not attention modules; layers and blocks skipped by skip-layer guidance keep
    # their index (each processor knows its layer).
    from diffusers_tiny import tiny_transformer

    tr = tiny_transformer("sd3", num_layers=3, dual_attention_layers=(0, 1))
    inputs = forward_inputs("sd3")
    pd.apply_pisa(tr, density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=2, dense_steps=0)
    calls = []
    remove = pd.hooks.add_observer(tr, lambda c: calls.append((c.layer, c.meta["block"], c.dense)))
    try:
        with torch.no_grad():
            tr(**inputs)
            assert calls == [(0, 0, True), (1, 0, True), (2, 1, True), (3, 1, True), (4, 2, False)]
            calls.clear()
            tr(**inputs, skip_layers=[0])
            assert calls == [(2, 1, True), (3, 1, True), (4, 2, False)]
    finally:
        remove()
        pd.remove_pisa(tr)
