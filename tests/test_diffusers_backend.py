"""The "pisa" dispatcher backend: registration, version guard, dispatcher argument handling,
backend switching, SD3 processor routing, masks, torch.compile."""

import pytest
import torch

pytest.importorskip("diffusers")

import pisa_attn.diffusers as pd  # noqa: E402
from diffusers.models import attention_dispatch as ad  # noqa: E402
from pisa_attn import pisa_attention  # noqa: E402
from pisa_attn.diffusers import backend  # noqa: E402
from pisa_attn.diffusers import calls as pisa_calls  # noqa: E402
from pisa_attn.diffusers.state import key_lengths  # noqa: E402
from diffusers_tiny import TILE_BLOCK, forward_inputs, prompt_kwargs, tiny_pipeline, tiny_transformer  # noqa: E402


def _qkv(b=1, lq=128, lk=128, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, generator=g) for n in (lq, lk, lk))


def test_registered_in_dispatcher():
    member = pd.register()
    assert pd.register() is member  # idempotent
    assert ad.AttentionBackendName("pisa") is member is ad.AttentionBackendName.PISA
    assert member.value == "pisa" and member.name == "PISA"
    assert "pisa" in {m.value for m in ad.AttentionBackendName.__members__.values()}
    assert ad._AttentionBackendRegistry._backends[member] is backend.dispatcher_attention
    assert member in ad._AttentionBackendRegistry.list_backends()


def test_version_guard(monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    with pytest.raises(RuntimeError, match=r"tested with diffusers 0\.42\.x; found diffusers 0\.43\.0"):
        pd.register()
    with pytest.raises(RuntimeError, match="diffusers>=0.42,<0.43"):
        pd.apply_pisa(tiny_transformer("wan"))


def test_dispatch_through_context_manager_standalone():
    # Without apply_pisa: self-attention with >= min_kv_len keys runs PISA in the model's order.
    q, k, v = _qkv(lq=160, lk=160)
    old = pd.configure()
    try:
        pd.configure(density=0.25, block_size=TILE_BLOCK, min_kv_len=128)
        with ad.attention_backend("pisa"):
            out = ad.dispatch_attention_fn(q, k, v)
            short = ad.dispatch_attention_fn(q[:, :100], k[:, :100], v[:, :100])
            cross = ad.dispatch_attention_fn(q, k[:, :40], v[:, :40])
    finally:
        pd.configure(**old.__dict__)
    expect = pisa_attention(q, k, v, density=0.25, block_size=TILE_BLOCK, layout="bshd")
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    sdpa = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2)
    ).transpose(1, 2)
    torch.testing.assert_close(short, sdpa(q[:, :100], k[:, :100], v[:, :100]), rtol=0, atol=0)  # too few keys
    torch.testing.assert_close(cross, sdpa(q, k[:, :40], v[:, :40]), rtol=0, atol=0)  # cross-attention


def test_configure_validates():
    with pytest.raises(ValueError, match="density"):
        pd.configure(density=2.0)
    with pytest.raises(TypeError, match="unknown"):
        pd.configure(densty=0.2)
    with pytest.raises(ValueError, match="min_kv_len"):
        pd.configure(min_kv_len=-1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dropout_p=0.1), "dropout_p"),
        (dict(is_causal=True), "is_causal"),
        (dict(return_lse=True), "return_lse"),
        (dict(_parallel_config=object()), "context parallelism"),
    ],
)
def test_dispatcher_rejects_unsupported(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        backend.dispatcher_attention(q, k, v, **kwargs)


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


def test_standalone_sparse_call_honours_padding_mask():
    q, k, v = _qkv(b=2, lq=160, lk=160)
    mask = torch.ones(2, 160, dtype=torch.bool)
    mask[1, 130:] = False
    old = pd.configure()
    try:
        pd.configure(density=0.25, block_size=TILE_BLOCK, min_kv_len=0)
        out = backend.dispatcher_attention(q, k, v, attn_mask=mask)
    finally:
        pd.configure(**old.__dict__)
    kw = dict(density=0.25, block_size=TILE_BLOCK, layout="bshd")
    torch.testing.assert_close(out[:1], pisa_attention(q[:1], k[:1], v[:1], **kw), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[1:], pisa_attention(q[1:], k[1:, :130], v[1:, :130], **kw), rtol=1e-6, atol=1e-6)


def test_set_attention_backend_switches_after_apply():
    tr, inputs = tiny_transformer("flux"), forward_inputs("flux")
    with torch.no_grad():
        native = tr(**inputs).sample
        pd.apply_pisa(tr, density=0.25, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0)
        sparse = tr(**inputs).sample
        tr.set_attention_backend("native")
        again_native = tr(**inputs).sample  # tiling stays on; exact attention is order-independent
        tr.set_attention_backend("pisa")
        again_sparse = tr(**inputs).sample
        pd.remove_pisa(tr)
    ad._AttentionBackendRegistry.set_active_backend(ad.AttentionBackendName.NATIVE)  # set_* changed the global
    assert not torch.allclose(sparse, native, rtol=0, atol=1e-4)
    torch.testing.assert_close(again_native, native, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again_sparse, sparse, rtol=0, atol=0)


def test_sd3_processor_routed_through_dispatcher():
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    from pisa_attn.diffusers.processors import joint_attention

    tr, inputs = tiny_transformer("sd3"), forward_inputs("sd3", batch=2)
    originals = {n: m.processor for n, m in tr.named_modules() if hasattr(m, "processor")}
    assert all(type(p) is JointAttnProcessor2_0 for p in originals.values())
    routed = []
    with torch.no_grad():
        native = tr(**inputs).sample
        for m in tr.modules():
            if hasattr(m, "processor"):  # the dispatcher path of the processor, on the native backend
                def via(attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
                    routed.append(1)
                    return joint_attention(attn, hidden_states, encoder_hidden_states, ad.AttentionBackendName.NATIVE)

                m.processor = via
        via_dispatcher = tr(**inputs).sample
        for n, m in tr.named_modules():
            if hasattr(m, "processor"):
                m.processor = originals[n]
        pd.apply_pisa(tr, density=0.5)
        assert all(m.processor._attention_backend == "pisa" for n, m in tr.named_modules() if n.endswith("attn"))
        pd.remove_pisa(tr)
    assert len(routed) == 3
    torch.testing.assert_close(via_dispatcher, native, rtol=1e-6, atol=1e-6)
    assert all(m.processor is originals[n] for n, m in tr.named_modules() if hasattr(m, "processor"))
    assert all("_attention_backend" not in vars(p) for p in originals.values())


def test_processor_without_dispatcher_rejected():
    from diffusers.models.attention_processor import AttnProcessor2_0

    tr = tiny_transformer("hunyuan")
    tr.transformer_blocks[0].attn.set_processor(AttnProcessor2_0())
    with pytest.raises(ValueError, match="AttnProcessor2_0"):
        pd.apply_pisa(tr)
    assert pd.pisa_state(tr) is None
    assert all(getattr(m.processor, "_attention_backend", None) is None for m in tr.modules() if hasattr(m, "processor"))


def test_cross_attention_and_refiner_stay_dense_under_global_pisa():
    # set_attention_backend("pisa") also reaches Wan's cross-attention: it must stay dense and uncounted.
    tr, inputs = tiny_transformer("wan"), forward_inputs("wan")
    with torch.no_grad():
        pd.apply_pisa(tr, density=1.0, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)
        ref = tr(**inputs).sample
        tr.set_attention_backend("pisa")
        out = tr(**inputs).sample
        assert pd.stats(tr) == {"sparse": 4}  # 2 self-attention layers x 2 calls, attn2 not counted
        pd.remove_pisa(tr)
    ad._AttentionBackendRegistry.set_active_backend(ad.AttentionBackendName.NATIVE)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_hunyuan_refiner_stays_dense_under_global_pisa():
    # The token refiner's text-only attention is not a PISA layer (in diffusers 0.42 its processor
    # calls SDPA itself; were it dispatched, its length would not match a managed sequence).
    tr, inputs = tiny_transformer("hunyuan"), forward_inputs("hunyuan")
    with torch.no_grad():
        pd.apply_pisa(tr, density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)
        ref = tr(**inputs).sample
        tr.set_attention_backend("pisa")
        out = tr(**inputs).sample
        assert pd.stats(tr) == {"sparse": 4}
        # A dispatched text-only self-attention inside a forward: dense, not counted as a layer.
        from pisa_attn.diffusers.models import CallInfo
        from pisa_attn.diffusers.state import Run, enter_run, exit_run

        state = pd.pisa_state(tr)
        (layouts,) = state.layouts.values()
        run = Run(state, 3, CallInfo((3, 6, 10), 8, 0.5), layouts)
        q, k, v = _qkv(lq=8, lk=8)
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
        token = enter_run(run)
        try:
            text_only = pisa_calls.attend(q, k, v, mask, None, False)
        finally:
            exit_run(token)
        pd.remove_pisa(tr)
    ad._AttentionBackendRegistry.set_active_backend(ad.AttentionBackendName.NATIVE)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert run.layer == 0
    torch.testing.assert_close(text_only, pisa_calls.dense_attention(q, k, v, mask, None, False), rtol=0, atol=0)


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
            return [pisa_calls.attend(q, k, v, m, scale, False) for m, scale in calls_args]
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


def test_sd3_follows_set_attention_backend_and_context_manager(monkeypatch):
    # SD3's JointAttnProcessor2_0 calls SDPA itself: selecting "pisa" used to change nothing.
    tr, inputs = tiny_transformer("sd3"), forward_inputs("sd3")
    calls = []
    unmanaged = pisa_calls._attend_unmanaged
    monkeypatch.setattr(pisa_calls, "_attend_unmanaged", lambda *a: calls.append(a[0].shape) or unmanaged(*a))
    old = pd.configure()
    try:
        with torch.no_grad():
            native = tr(**inputs).sample
            pd.configure(density=1.0, block_size=TILE_BLOCK, min_kv_len=0)
            with ad.attention_backend("pisa"):
                exact = tr(**inputs).sample
            assert len(calls) == 3  # attn and attn2 of block 0, attn of block 1
            pd.configure(density=0.25)
            with ad.attention_backend("pisa"):
                sparse = tr(**inputs).sample
            tr.set_attention_backend("pisa")
            via_set = tr(**inputs).sample
            assert len(calls) == 9
            tr.reset_attention_backend()
            ad._AttentionBackendRegistry.set_active_backend(ad.AttentionBackendName.NATIVE)
            again = tr(**inputs).sample
    finally:
        pd.configure(**old.__dict__)
        ad._AttentionBackendRegistry.set_active_backend(ad.AttentionBackendName.NATIVE)
    torch.testing.assert_close(exact, native, rtol=1e-5, atol=1e-5)  # same math through the dispatcher
    assert not torch.allclose(sparse, native, rtol=0, atol=1e-4)
    torch.testing.assert_close(via_set, sparse, rtol=0, atol=0)
    assert torch.equal(again, native) and len(calls) == 9  # back on SD3's own processor


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
        out = pisa_calls.sparse_attention(q, k, v, seq, None, None, (0.25, mode, False, TILE_BLOCK))
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
            out = pisa_calls.attend(image.to_tiled(q, 1), k, v, mask, None, False)
        finally:
            exit_run(token)
    finally:
        pd.remove_pisa(tr)
    expect = image.to_tiled(pisa_calls.dense_attention(q, k, v, mask, None, False), 1)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
