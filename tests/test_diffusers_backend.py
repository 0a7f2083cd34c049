"""PISA's attention processors: what they compute, that diffusers' dispatcher is left alone, the
version guard, masks, observers, torch.compile."""

import pytest
import torch

pytest.importorskip("diffusers")

import pisa_attn.diffusers as pd  # noqa: E402
from diffusers.models import attention_dispatch as ad  # noqa: E402
from pisa_attn import pisa_attention  # noqa: E402
from pisa_attn.settings import PisaSettings  # noqa: E402
from pisa_attn.diffusers import calls as pisa_calls  # noqa: E402
from pisa_attn.diffusers.state import key_lengths  # noqa: E402
from diffusers_tiny import TILE_BLOCK, forward_inputs, prompt_kwargs, tiny_pipeline, tiny_transformer  # noqa: E402


def _qkv(b=1, lq=128, lk=128, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, generator=g) for n in (lq, lk, lk))


def test_no_backend_registered_in_dispatcher():
    # Backend names are a closed enum: PISA adds none (apply_pisa is the entry point).
    assert "pisa" not in {m.value for m in ad.AttentionBackendName.__members__.values()}
    assert not any(getattr(k, "value", k) == "pisa" for k in ad._AttentionBackendRegistry._backends)
    with pytest.raises(ValueError, match="must be one of"):
        tiny_transformer("wan").set_attention_backend("pisa")


@pytest.mark.parametrize("family", ["flux", "sd3", "wan", "hunyuan"])
def test_processors_compute_what_the_originals_do(family):
    # At density 1 every key block is exact: PISA's processors must give the model's own output.
    from pisa_attn.diffusers.processors import PROCESSORS

    tr, inputs = tiny_transformer(family), forward_inputs(family, batch=2)
    originals = {n: m.processor for n, m in tr.named_modules() if hasattr(m, "processor")}
    with torch.no_grad():
        native = tr(**inputs).sample
        pd.apply_pisa(tr, density=1.0, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)
        mine = [(n, m.processor) for n, m in tr.named_modules() if isinstance(m.__dict__.get("processor"), PROCESSORS[family])]
        assert [p.layer for _, p in mine] == list(range(len(mine))) and mine
        assert all(p.original is originals[n] for n, p in mine)
        out = tr(**inputs).sample
        assert pd.stats(tr) == {"sparse": len(mine)}
        pd.remove_pisa(tr)
        again = tr(**inputs).sample
    torch.testing.assert_close(out, native, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, native)
    assert all(m.processor is originals[n] for n, m in tr.named_modules() if hasattr(m, "processor"))


def test_version_guard(monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    with pytest.raises(RuntimeError, match=r"tested with diffusers 0\.42\.x.*found diffusers 0\.43\.0"):
        pd.check_diffusers()
    with pytest.raises(RuntimeError, match="diffusers>=0.42,<0.43"):
        pd.apply_pisa(tiny_transformer("wan"))


def test_key_lengths():
    mask = torch.ones(2, 10, dtype=torch.bool)
    assert key_lengths(mask, 2, 10) is None
    mask[0, 7:] = False
    assert key_lengths(mask[:, None, None], 2, 10) == [7, 10]
    additive = torch.zeros(1, 10).masked_fill(~mask[:1], float("-inf"))
    assert key_lengths(additive, 3, 10) == [7, 7, 7]
    holes = torch.ones(1, 10, dtype=torch.bool)
    holes[0, 3] = False
    with pytest.raises(ValueError, match="prefix"):
        key_lengths(holes, 1, 10)
    with pytest.raises(ValueError, match="key-padding"):
        key_lengths(torch.ones(1, 1, 10, 10, dtype=torch.bool), 1, 10)
    with pytest.raises(ValueError, match="no valid key"):
        key_lengths(torch.zeros(1, 10, dtype=torch.bool), 1, 10)
    # masked entries as diffusers writes them (-10000, the dtype's minimum) count as masked; a soft
    # bias is no key count: a clear error, not keys silently dropped
    assert key_lengths(torch.zeros(1, 10).masked_fill(~mask[:1], -10000.0), 1, 10) == [7]
    assert key_lengths(torch.zeros(1, 10, dtype=torch.bfloat16).masked_fill(~mask[:1], -3.0e38), 1, 10) == [7]
    soft = torch.zeros(1, 10)
    soft[0, 1:] = -0.5
    with pytest.raises(ValueError, match="attention_mask holds additive biases"):
        key_lengths(soft, 1, 10)
    with pytest.raises(ValueError, match="attention_mask holds additive biases"):
        key_lengths(torch.full((1, 10), -0.5), 1, 10)


def test_diffusers_backend_changes_while_managed_reach_the_original_processors():
    # set_attention_backend on a managed model leaves PISA running (it is the layers' backend); what
    # it set is what the original processors carry after remove_pisa, as if PISA had not been there.
    tr, inputs = tiny_transformer("flux"), forward_inputs("flux")
    with torch.no_grad():
        pd.apply_pisa(tr, density=0.25, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0)
        sparse = tr(**inputs).sample
        tr.set_attention_backend("native")
        assert torch.equal(tr(**inputs).sample, sparse)
        pd.remove_pisa(tr)
    ad._AttentionBackendRegistry.set_active_backend(ad.AttentionBackendName.NATIVE)  # set_* changed the global
    assert all(m.processor._attention_backend == "native" for m in tr.modules() if hasattr(m, "processor"))


def test_processor_without_dispatcher_rejected():
    from diffusers.models.attention_processor import AttnProcessor2_0

    tr = tiny_transformer("hunyuan")
    tr.transformer_blocks[0].attn.set_processor(AttnProcessor2_0())
    before = {n: m.processor for n, m in tr.named_modules() if hasattr(m, "processor")}
    with pytest.raises(ValueError, match="AttnProcessor2_0"):
        pd.apply_pisa(tr)
    assert pd.pisa_state(tr) is None
    assert before == {n: m.processor for n, m in tr.named_modules() if hasattr(m, "processor")}


def test_cross_attention_and_refiner_keep_their_processors():
    # Only the adapter's self-attention modules get PISA processors: Wan's cross-attention and
    # Hunyuan's text token refiner keep their own and stay uncounted.
    for family, untouched in (("wan", "blocks.0.attn2"), ("hunyuan", "context_embedder.token_refiner")):
        tr, inputs = tiny_transformer(family), forward_inputs(family)
        before = {n: m.processor for n, m in tr.named_modules() if n.startswith(untouched) and hasattr(m, "processor")}
        assert before
        with torch.no_grad():
            pd.apply_pisa(tr, density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)
            tr(**inputs)
            assert pd.stats(tr) == {"sparse": 2}
            assert before == {n: tr.get_submodule(n).processor for n in before}
            pd.remove_pisa(tr)


def _hunyuan_run():
    """A managed tiny HunyuanVideo after one forward, and a Run of its layouts (no_grad inside)."""
    from pisa_attn.diffusers.models import CallInfo
    from pisa_attn.diffusers.state import Run

    tr, inputs = tiny_transformer("hunyuan"), forward_inputs("hunyuan")
    pd.apply_pisa(tr, density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)
    tr(**inputs)
    state = pd.pisa_state(tr)
    (layouts,) = state.layouts.values()
    return tr, state, layouts, Run(state, 3, CallInfo((3, 6, 10), 8, 0.5), layouts)


def test_text_only_call_inside_a_forward_runs_dense_uncounted():
    from pisa_attn.diffusers.state import enter_run, exit_run

    with torch.no_grad():
        tr, state, _, run = _hunyuan_run()
        q, k, v = _qkv(lq=8, lk=8)
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
        token = enter_run(run)
        try:
            text_only = pisa_calls.attend(state, 0, q, k, v, mask)
        finally:
            exit_run(token)
        assert pd.stats(tr) == {"sparse": 2}
        outside = pisa_calls.attend(state, 0, q, k, v, None)  # no forward running: exact attention
        pd.remove_pisa(tr)
    torch.testing.assert_close(text_only, pisa_calls.dense_attention(q, k, v, mask, None, False), rtol=0, atol=0)
    torch.testing.assert_close(outside, pisa_calls.dense_attention(q, k, v, None, None, False), rtol=0, atol=0)


def test_compiled_blocks_do_not_recompile_per_step():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    pipe = tiny_pipeline("wan")
    pipe.set_progress_bar_config(disable=True)
    pd.apply_pisa(pipe, density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=1, dense_steps=1)
    dense = []
    pd.hooks.add_observer(pipe.transformer, lambda c: dense.append(c.dense))
    try:
        with torch.no_grad():
            eager = pipe(**prompt_kwargs("wan"), num_inference_steps=3)[0]
            for block in pipe.transformer.blocks:
                block.compile(backend="eager", fullgraph=True)
            pipe(**prompt_kwargs("wan"), num_inference_steps=1)  # compiles; dense step only
            graphs = counters["stats"]["unique_graphs"]
            dense.clear()
            compiled = pipe(**prompt_kwargs("wan"), num_inference_steps=3)[0]  # dense -> sparse steps
            assert counters["stats"]["unique_graphs"] == graphs
    finally:
        pd.remove_pisa(pipe)
        torch._dynamo.reset()
    assert dense.count(False) == 4 and dense.count(True) == 8  # the schedule still switches inside the graph
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_observers_get_key_lengths_and_scale_of_dense_and_sparse_calls():
    # Observers of dense calls used to get key_lens=None (only the sparse path read the mask), and
    # no record said which softmax scale the call used.
    from pisa_attn.diffusers.models import CallInfo
    from pisa_attn.diffusers.state import Run, enter_run, exit_run

    tr, inputs = tiny_transformer("hunyuan"), forward_inputs("hunyuan")
    calls = []

    def attend_in_run(calls_args):
        """calls.attend in a fresh forward run (layers 0, 1, ...) of ``tr``."""
        token = enter_run(Run(state, 0, CallInfo((3, 6, 10), 8, 0.5), layouts))
        try:
            return [pisa_calls.attend(state, layer, q, k, v, m, scale) for layer, (m, scale) in enumerate(calls_args)]
        finally:
            exit_run(token)

    with torch.no_grad():
        pd.apply_pisa(tr, density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=1, dense_steps=0)
        tr(**inputs)  # builds the layouts
        state = pd.pisa_state(tr)
        (layouts,) = state.layouts.values()
        n = layouts.joint.length
        q, k, v = _qkv(b=2, lq=n, lk=n)
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[0, n - 3 :], mask[1, n - 1 :] = False, False  # padded trailing text keys
        causal = mask[:, None, None].expand(2, 1, n, n).tril()  # not a key-padding mask
        attend_in_run([(causal, None)])  # a dense call takes any mask...
        remove = pd.hooks.add_observer(tr, calls.append)
        try:
            with pytest.raises(ValueError, match="observers"):  # ...but observers need its key lengths
                attend_in_run([(causal, None)])
            outs = attend_in_run([(mask, 0.1), (mask, None)])  # layer 0 runs dense, layer 1 sparse
        finally:
            remove()
            pd.remove_pisa(tr)
    assert [c.dense for c in calls] == [True, False]
    assert [c.meta["key_lens"] for c in calls] == [[n - 3, n - 1]] * 2
    assert calls[0].scale == 0.1 and calls[1].scale == 16**-0.5
    dense = calls[0]
    torch.testing.assert_close(dense.out, outs[0].transpose(1, 2), rtol=0, atol=0)
    for row, m in enumerate(dense.meta["key_lens"]):  # what the record says reproduces the call
        exact = torch.nn.functional.scaled_dot_product_attention(
            dense.q[row], dense.k[row, :, :m], dense.v[row, :, :m], scale=dense.scale
        )
        torch.testing.assert_close(dense.out[row], exact, rtol=1e-5, atol=1e-6)


def _flux_masked(mask, **settings):
    """(native, PISA) FLUX outputs with ``attention_mask`` over the joint [text, image] sequence."""
    tr, inputs = tiny_transformer("flux"), forward_inputs("flux")
    inputs["joint_attention_kwargs"] = {"attention_mask": mask}
    with torch.no_grad():
        native = tr(**inputs).sample
        pd.apply_pisa(tr, block_size=TILE_BLOCK, min_kv_len=0, **settings)
        try:
            return native, tr(**inputs).sample
        finally:
            pd.remove_pisa(tr)


def _flux_joint_layout():
    from pisa_attn.diffusers.tiling import build_layouts

    return build_layouts((16, 16), 16, "before", (4, 4), TILE_BLOCK).joint.layout


@pytest.mark.parametrize("shape", ["key_padding", "full"])
def test_mask_follows_tokens_on_dense_calls(shape):
    # Dense (warm-up) calls used to apply the mask in model order to keys PISA had re-ordered.
    n = 16 + 256
    g = torch.Generator().manual_seed(0)
    if shape == "key_padding":
        mask = torch.rand(1, n, generator=g) > 0.3  # masks scattered image (and text) keys
    else:
        mask = (torch.rand(1, 1, n, n, generator=g) > 0.5) | torch.eye(n, dtype=torch.bool)
    native, pisa = _flux_masked(mask, density=0.5, dense_steps=1)
    torch.testing.assert_close(pisa, native, rtol=1e-5, atol=1e-5)


def test_mask_follows_tokens_on_sparse_calls():
    # A mask whose valid keys are a prefix once tiled (not in model order) runs sparse on the
    # right keys; at density 1 that is the masked dense output.
    n, layout = 16 + 256, _flux_joint_layout()
    tiled = torch.zeros(1, n, dtype=torch.bool)
    tiled[:, : n - 40] = True
    mask = layout.from_tiled(tiled, 1)
    assert not torch.equal(mask, tiled)
    native, pisa = _flux_masked(mask, density=1.0, dense_layers=0, dense_steps=0)
    torch.testing.assert_close(pisa, native, rtol=1e-5, atol=1e-5)


def test_mask_that_tiling_breaks_is_refused_on_sparse_calls():
    # Valid keys a prefix in model order (text + the first image rows) are not one once tiled: the
    # sparse kernel cannot honour that mask, so the call refuses it instead of masking other keys.
    n = 16 + 256
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[:, : n - 40] = True
    with pytest.raises(ValueError, match="attention mask.*token tiling"):
        _flux_masked(mask, density=0.5, dense_layers=0, dense_steps=0)


def _misaligned_joint(text_len=13, grid=(6, 10), seed=0):
    """q/k/v [B, L, H, D] of a [text][image] sequence whose image starts mid-block, and its Sequence."""
    from pisa_attn.diffusers.tiling import build_layouts

    seq = build_layouts(grid, text_len, "before", (4, 4), TILE_BLOCK).joint
    q, k, v = _qkv(lq=seq.length, lk=seq.length, seed=seed)
    return q, k, v, seq


def test_image_query_blocks_follow_the_key_tile_grid():
    # 13 text tokens before the image: cut at the first image query, every 16-row query block would
    # straddle two key tiles. The image queries must get what PISA gives them in the sequence's own
    # block grid (the one the key blocks and tiles follow).
    q, k, v, seq = _misaligned_joint()
    lo, hi = seq.image_lo, seq.image_hi
    assert lo % TILE_BLOCK
    for mode in ("zeroth", "hybrid"):
        settings = PisaSettings(density=0.25, mode=mode, block_size=TILE_BLOCK, layout="bshd", covariance_aware=False)
        out = pisa_calls.sparse_attention(q, k, v, seq, None, settings)
        torch.testing.assert_close(pisa_calls.sparse_attention(q, k, v, seq, None, settings, plans={}), out,
                                   rtol=0, atol=0)  # on a plan: the same
        whole = pisa_attention(q, k, v, density=0.25, mode=mode, block_size=TILE_BLOCK, layout="bshd",
                               keep_blocks=seq.keep, covariance_aware=False)  # fmt: skip
        torch.testing.assert_close(out[:, lo:hi], whole[:, lo:hi], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[:, :lo], pisa_calls.dense_attention(q[:, :lo], k, v, None, None, False))


def test_per_query_mask_of_other_calls_follows_the_image_tokens():
    # A call PISA does not manage (Wan's cross-attention: image queries, text keys) inside a managed
    # forward sees its queries in tiled order: a per-query mask must be reordered like them.
    from pisa_attn.diffusers.models import CallInfo
    from pisa_attn.diffusers.state import Run, enter_run, exit_run

    tr = tiny_transformer("wan")
    pd.apply_pisa(tr, density=0.5, block_size=TILE_BLOCK, min_kv_len=0)
    try:
        with torch.no_grad():
            tr(**forward_inputs("wan"))
        state = pd.pisa_state(tr)
        (layouts,) = state.layouts.values()
        image = layouts.image
        n = image.num_tokens
        q, k, v = _qkv(lq=n, lk=8)
        g = torch.Generator().manual_seed(1)
        mask = (torch.rand(1, 1, n, 8, generator=g) > 0.5) | torch.eye(n, 8, dtype=torch.bool)
        mask[..., 0] = True  # every query keeps a key
        token = enter_run(Run(state, 0, CallInfo((3, 6, 10), 0, 0.5), layouts))
        try:
            out = pisa_calls.attend(state, 0, image.to_tiled(q, 1), k, v, mask)
        finally:
            exit_run(token)
    finally:
        pd.remove_pisa(tr)
    expect = image.to_tiled(pisa_calls.dense_attention(q, k, v, mask, None, False), 1)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)


def test_a_forwards_mask_cache_tells_a_transposed_view_and_keeps_its_masks_alive():
    """A run reorders each attention mask once per forward, found again by where it lives: a
    transposed view of a square mask shares its address and shape but not its contents' order, and
    a mask freed within the forward must not leave its address to a new mask's cache hit."""
    import gc
    import weakref

    with torch.no_grad():
        tr, _, layouts, run = _hunyuan_run()
        seq = layouts.joint
        n = seq.layout.num_tokens
        mask = torch.rand(1, 1, n, n, generator=torch.Generator().manual_seed(0)) > 0.5
        tiled = run.tiled_mask(mask, seq, 1)
        torch.testing.assert_close(run.tiled_mask(mask.transpose(-1, -2), seq, 1), tiled.transpose(-1, -2))
        probe = weakref.ref(mask)
        del mask
        gc.collect()
        assert probe() is not None  # held by the run until it ends
        pd.remove_pisa(tr)
