"""torch.compile of a PISA-managed transformer: the whole model compiles with fullgraph=True, nothing
recompiles as the timestep and the warm-up schedule change, same output and schedule as eager.

``torch.compile(transformer)`` runs a user module's hooks as frames of their own, so a managed
transformer gives two graphs: the forward pre-hook's (the opaque op that opens the run and returns
the token permutation) and the forward's (attention ops, permutations, the op closing the run).
"""

import pytest
import torch

pytest.importorskip("diffusers")

import pisa_attn.diffusers as pd  # noqa: E402
from diffusers_tiny import FAMILIES, TILE_BLOCK, forward_inputs, prompt_kwargs, tiny_pipeline, tiny_transformer  # noqa: E402

STEPS = 3
SETTINGS = dict(density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=1, dense_steps=1)


class CountingBackend:
    """A torch.compile backend that runs the captured graph as is and counts the graphs it gets."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _generate(pipe, family):
    with torch.no_grad():
        return pipe(**prompt_kwargs(family), num_inference_steps=STEPS)[0]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_compiles_once_across_steps(family, fresh_dynamo):
    pipe = tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    pd.apply_pisa(pipe, **SETTINGS)
    calls = []
    pd.hooks.add_observer(pipe.transformer, lambda c: calls.append((c.step, c.layer, c.meta["block"], c.dense)))
    try:
        eager = _generate(pipe, family)
        eager_calls, eager_stats = list(calls), pd.stats(pipe.transformer)
        calls.clear()
        backend = CountingBackend()
        pipe.transformer = torch.compile(pipe.transformer, backend=backend, fullgraph=True)
        compiled = _generate(pipe, family)  # dense warm-up step, then sparse steps
        assert backend.graphs == 2  # pre-hook and forward, compiled once (a recompile raises)
        assert calls == eager_calls and pd.stats(pipe.transformer) == eager_stats
        assert {d for *_, d in calls} == {True, False}  # the schedule switched inside the graph
        again = _generate(pipe, family)  # a second generation: no new graph either
        assert backend.graphs == 2
    finally:
        pd.remove_pisa(pipe)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(again, eager, rtol=0, atol=0)


def test_compiled_transformer_alone_tracks_steps(fresh_dynamo):
    # Without a pipeline the step comes from the timestep values, read when the graph runs.
    tr = tiny_transformer("flux")
    pd.apply_pisa(tr, **{**SETTINGS, "dense_steps": 2})
    steps = []
    pd.hooks.add_observer(tr, lambda c: steps.append(c.step) if c.layer == 0 else None)
    backend = CountingBackend()
    compiled = torch.compile(tr, backend=backend, fullgraph=True)
    try:
        with torch.no_grad():
            for t in (0.9, 0.6, 0.3, 0.9):
                compiled(**forward_inputs("flux", timestep=t))
        assert steps == [0, 1, 2, 0] and backend.graphs == 2
        assert pd.stats(compiled) == {"dense": 4, "warmup_step": 4}  # a new generation restarted the counts
    finally:
        pd.remove_pisa(tr)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_compile_repeated_blocks_still_works(family):
    # Per-block compilation: the blocks' graphs hold the attention op; the boundary hooks run eagerly.
    torch._dynamo.reset()
    pipe = tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    pd.apply_pisa(pipe, **SETTINGS)
    backend = CountingBackend()
    try:
        eager = _generate(pipe, family)
        pipe.transformer.compile_repeated_blocks(fullgraph=True, backend=backend)
        compiled = _generate(pipe, family)
        graphs = backend.graphs
        again = _generate(pipe, family)
        assert backend.graphs == graphs  # the step and the schedule never enter a guard
    finally:
        pd.remove_pisa(pipe)
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(again, eager, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_whole_model_compiles_once(fresh_dynamo):
    # The real compiler (C++ through inductor; on the CPU the attention is the reference backend's
    # graph, lowered with the rest): no recompile across the dense -> sparse switch and a second
    # generation (error_on_recompile), output within float tolerance of eager.
    pipe = tiny_pipeline("wan")
    pipe.set_progress_bar_config(disable=True)
    pd.apply_pisa(pipe, **SETTINGS)
    try:
        eager = _generate(pipe, "wan")
        pipe.transformer = torch.compile(pipe.transformer, fullgraph=True)
        compiled = _generate(pipe, "wan")
        again = _generate(pipe, "wan")
        assert pd.stats(pipe.transformer) == {"dense": 8, "warmup_step": 4, "warmup_layer": 4, "sparse": 4}
    finally:
        pd.remove_pisa(pipe)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, compiled, rtol=0, atol=0)
