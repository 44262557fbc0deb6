"""Tests for autopar.verify.rule_check: every strategy of every op, run alone on the ranks."""

from __future__ import annotations

import pytest

from autopar.verify.rule_check import check_rules
from examples import families, zoo

pytest.importorskip("transformers")


def test_every_strategy_of_mamba2_zaya_and_biogpt_runs_like_one_device() -> None:
    """Mamba-2's chunked scan (cumsum over its last dim) and Zaya's query-key norms (a 2-norm over the head
    dim) are where two of DTensor's rules, taken on trust, computed other values: a scan split along the dim
    it scans, a p-norm's partial read as a sum. BioGPT's layer norms: ``native_layer_norm_backward`` reads
    its mean and rstd as if dense, and a shard cut from a whole tensor was a strided view (the sharding
    interpreter's constants, and these checks' inputs). Every strategy the search may choose for every op of
    the three models, each run alone on 2 processes, computes the op's value; those ops' among them."""
    mamba2, zaya, biogpt = check_rules(
        [families.FAMILIES["mamba2"], zoo.factory("Zaya"), zoo.factory("BioGpt")], (1, 2)
    )
    for model, check in (("Mamba-2", mamba2), ("Zaya", zaya), ("BioGPT", biogpt)):
        assert check.wrong == [], f"{model}: " + "; ".join(map(str, check.wrong[:3]))
        assert check.checked > 250 and check.nodes > 250, (model, check.checked, check.nodes)
    assert mamba2.ops["aten.cumsum.default"] >= 2
    assert zaya.ops["aten.linalg_vector_norm.default"] >= 1
    assert biogpt.ops["aten.native_layer_norm_backward.default"] >= 3


def test_a_mesh_that_is_not_dp_by_tp_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="not a dp x tp shape"):
        check_rules([families.FAMILIES["mamba2"]], (2,))
