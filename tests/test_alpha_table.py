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
