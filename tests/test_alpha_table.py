"""Saved per-layer alpha tables (pisa_attn.alpha_table): JSON round trip and checks."""

from __future__ import annotations

import numpy as np
import pytest

from pisa_attn.alpha_table import AlphaTable, LayerAlpha, from_json, load


def _doc(layers):
    return {"format": "pisa-attn-alpha", "version": 1, "transformers": {"transformer": layers}}


def test_a_layer_given_twice_is_refused():
    # a dict made in code may key layer 3 as 3 and as "3": one of the two weights would be lost
    with pytest.raises(ValueError, match="alpha_table.*layer 3.*twice"):
        from_json(_doc({3: {"alpha": [1.0]}, "3": {"alpha": [0.5]}}))


def test_numpy_scalars_round_trip_through_save(tmp_path):
    """A table built in code with numpy numbers (the settings of a numpy-typed call, fitted
    weights) is saved as their Python values, not refused by JSON after the fit."""
    table = AlphaTable({"transformer": {np.int64(2): LayerAlpha((np.float64(0.5), np.float32(0.25)),
                                                                tail_mass=np.float32(0.3), rows=np.int64(8),
                                                                covariance_aware=np.True_)}},
                       settings={"density": np.float32(0.15), "block_size": np.int64(64),
                                 "covariance_aware": np.False_})
    back = load(table.save(tmp_path / "t.json"))
    assert back.settings == {"density": 0.15, "block_size": 64, "covariance_aware": False}
    assert [type(x) for x in back.settings.values()] == [float, int, bool]
    entry = back.layers()[2]
    assert entry == LayerAlpha((0.5, 0.25), 0.3, 8, None, True)
    assert load(table) == back


def test_a_layer_given_twice_in_a_file_is_refused(tmp_path):
    # json.load keeps the last of two equal keys: a hand-merged file would lose a weight silently
    path = tmp_path / "t.json"
    path.write_text('{"format": "pisa-attn-alpha", "version": 1, "transformers": {"transformer": '
                    '{"3": {"alpha": [1.0]}, "3": {"alpha": [0.5]}}}}')
    with pytest.raises(ValueError, match="alpha_table.*duplicate key '3'"):
        load(path)
    path.write_text('{"format": "pisa-attn-alpha", "version": 1, "transformers": {"transformer": '
                    '{"3": {"alpha": [1.0]}, "4": {"alpha": [0.5]}}}}')
    assert sorted(load(path).layers()) == [3, 4]


def test_a_failed_save_leaves_an_existing_file_as_it_was(tmp_path, monkeypatch):
    import builtins

    import pisa_attn.alpha_table as at

    path = tmp_path / "t.json"
    table = load({"format": "pisa-attn-alpha", "version": 1, "transformers": {"transformer": {"3": {"alpha": [1.0]}}}})
    table.save(path)
    before = path.read_bytes()

    class FullDisk:
        def __init__(self, name, mode="r"):
            self.f = builtins.open(name, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:5])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(at, "open", FullDisk, raising=False)
    with pytest.raises(OSError, match="No space"):
        table.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # no temporary file left
