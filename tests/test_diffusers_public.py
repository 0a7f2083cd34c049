"""The diffusers integration on public machinery: diffusers itself is never changed, remove_pisa
restores a model bit for bit, a failed apply_pisa (its rollback included) never leaves a model
that says "managed" while it runs native attention, paths and layers are checked at the call, and
the README's diffusers snippet runs."""

import io
import os
import re

import pytest
import torch

pytest.importorskip("diffusers")

import pisa_attn.diffusers as pd  # noqa: E402
from pisa_attn.diffusers import apply as pisa_apply  # noqa: E402
from pisa_attn.diffusers import telemetry as tm  # noqa: E402
from diffusers_untouched import changed_by_pisa  # noqa: E402
from local_ranks import run_ranks  # noqa: E402
from diffusers_tiny import FAMILIES, TILE_BLOCK, forward_inputs, tiny_pipeline, tiny_transformer  # noqa: E402
from test_diffusers_apply import assert_same, snapshot  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SPARSE = dict(density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)


def test_library_never_changes_diffusers():
    # in a forked rank whose diffusers no pisa_attn.diffusers import has touched
    assert run_ranks(changed_by_pisa, 1)[0] == {"import": [], "apply": []}


@pytest.mark.parametrize("family", FAMILIES)
def test_remove_restores_bit_for_bit(family):
    pipe = tiny_pipeline(family)
    tr, inputs = pipe.transformer, forward_inputs(family)
    with torch.no_grad():
        native = tr(**inputs).sample
    before, weights = snapshot(pipe), {k: v.clone() for k, v in tr.state_dict().items()}
    pd.apply_pisa(pipe, **SPARSE)
    with torch.no_grad():
        assert not torch.equal(tr(**inputs).sample, native)
    pd.remove_pisa(pipe)
    assert_same(before, snapshot(pipe))  # every module's __dict__ (no forward / hook registry left), processors
    assert all(torch.equal(weights[k], v) for k, v in tr.state_dict().items())
    with torch.no_grad():
        assert torch.equal(tr(**inputs).sample, native)


def _runs_diffusers_processors(tr) -> bool:
    """True when no module of ``tr`` runs a PISA processor."""
    from pisa_attn.diffusers.processors import PisaProcessor

    return not any(isinstance(getattr(m, "processor", None), PisaProcessor) for m in tr.modules())


@pytest.mark.parametrize("where", ["hooks", "processors"])
@pytest.mark.parametrize("managed", [False, True], ids=["fresh", "managed"])
def test_failure_during_apply_and_its_rollback_never_half_managed(monkeypatch, where, managed):
    # The install fails, and so does putting the earlier settings back (the same step fails again):
    # the model must end either managed with its state, or native with pisa_state None.
    tr, inputs = tiny_transformer("wan"), forward_inputs("wan")
    with torch.no_grad():
        native = tr(**inputs).sample
    if managed:
        pd.apply_pisa(tr, **SPARSE)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected failure")

    if where == "hooks":
        monkeypatch.setattr(pisa_apply, "install", broken)
    else:  # fails on the second managed module, after the first was re-routed
        original_cls = pisa_apply.PROCESSORS["wan"]

        class Breaks(original_cls):
            def __init__(self, original, handle, layer):
                if layer == 1:
                    broken()
                super().__init__(original, handle, layer)

        monkeypatch.setitem(pisa_apply.PROCESSORS, "wan", Breaks)
    with pytest.raises(RuntimeError, match="injected failure") as info:
        pd.apply_pisa(tr, **{**SPARSE, "density": 0.25})
    monkeypatch.undo()
    assert len(calls) == (2 if managed else 1)  # the rollback tried to put the earlier state back
    if managed:
        assert any("runs native attention" in n for n in getattr(info.value, "__notes__", []))
    assert pd.pisa_state(tr) is None
    assert _runs_diffusers_processors(tr)
    assert not any("_diffusers_hook" in m.__dict__ or "forward" in m.__dict__ for m in tr.modules())
    with torch.no_grad():
        assert torch.equal(tr(**inputs).sample, native)


def test_failure_inside_undo_still_clears_the_state(monkeypatch):
    tr = tiny_transformer("wan")
    pd.apply_pisa(tr, **SPARSE)
    state = pd.pisa_state(tr)

    def breaks():
        raise RuntimeError("undo step broke")

    state.restore.insert(3, breaks)  # between other undo steps: the rest must still run
    with pytest.raises(RuntimeError, match="undo step broke"):
        pd.remove_pisa(tr)
    assert pd.pisa_state(tr) is None and not state.restore
    assert _runs_diffusers_processors(tr)


# --- edges answered at the call ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(path="/nonexistent_pisa_dir/x.safetensors"), "does not exist"),
        (dict(path=HERE), "is a directory"),
        (dict(path=3), "file path"),
        (dict(layers=[99]), r"layers \[99\] do not exist.*4 managed attention layers"),
    ],
)
def test_capture_refuses_bad_path_and_layers_at_the_call(tmp_path, kwargs, match):
    pipe = tiny_pipeline("flux")
    before = snapshot(pipe)
    kwargs = {"path": str(tmp_path / "x.safetensors"), **kwargs}
    exc = TypeError if kwargs["path"] == 3 else ValueError
    with pytest.raises(exc, match=match):
        pd.capture_qkv(pipe, **kwargs)
    assert pd.pisa_state(pipe.transformer) is None
    assert_same(before, snapshot(pipe))


@pytest.mark.parametrize(
    "heatmap, match",
    [("/nonexistent_pisa_dir/h.png", "does not exist"), ("{tmp}/h.unknownformat", "image format"),
     ("{tmp}", "directory")],
)
def test_report_checks_heatmap_before_printing(tmp_path, heatmap, match):
    from rich.console import Console

    tr = tiny_transformer("wan")
    pd.apply_pisa(tr, telemetry=True, **SPARSE)
    with torch.no_grad():
        tr(**forward_inputs("wan"))
    buf = io.StringIO()
    with pytest.raises(ValueError, match=match):
        pd.report(tr, heatmap=heatmap.format(tmp=tmp_path), console=Console(file=buf))
    assert buf.getvalue() == ""
    out = tmp_path / "h.png"
    pd.report(tr, heatmap=out, console=Console(file=buf))  # a good one still works
    assert out.stat().st_size > 0 and "PISA telemetry" in buf.getvalue()
    pd.remove_pisa(tr)
    assert tm.get(tr) is not None  # the records stay readable after remove_pisa


# --- the README ------------------------------------------------------------------------------------
def _readme_snippet() -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("### diffusers"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_diffusers_snippet_runs_on_a_tiny_pipeline(tmp_path, capsys):
    from diffusers_tiny import save_tiny_wan_pipeline

    path = save_tiny_wan_pipeline(tmp_path / "wan")
    code = _readme_snippet()
    # The checkpoint, device, dtype and size change; every other line runs as written.
    swaps = {
        '"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"': repr(path),
        'dtype=torch.bfloat16': 'dtype=torch.float32',
        '.to("cuda")': '.to("cpu")',
        'height=480, width=832, num_frames=81': 'height=96, width=160, num_frames=9, num_inference_steps=3',
    }
    for old, new in swaps.items():
        assert old in code, f"README snippet changed: {old!r} not found"
        code = code.replace(old, new)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    pipe = scope["pipe"]
    assert scope["video"].shape[:1] == (9,) and pd.pisa_state(pipe.transformer) is None
    assert "{'dense': 12, 'warmup_step': 12}" in capsys.readouterr().out  # 3 steps x cond/uncond x 2 layers
