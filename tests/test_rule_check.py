"""Tests for autopar.verify.rule_check: every strategy of every op, run alone on the ranks."""

from __future__ import annotations

import pytest

from autopar.verify.rule_check import check_rules
from examples import families, zoo

pytest.importorskip("transformers")


def test_every_strategy_of_mamba2_and_zaya_runs_like_one_device() -> None:
    """Mamba-2's chunked scan (cumsum over its last dim) and Zaya's query-key norms (a 2-norm over the head
    dim) are where two of DTensor's rules, taken on trust, computed other values: a scan split along the dim
    it scans, a p-norm's partial read as a sum. Every strategy the search may choose for every op of both
    models, each run alone on 2 processes, computes the op's value; the scans and norms among them."""
    mamba2, zaya = check_rules([families.FAMILIES["mamba2"], zoo.factory("Zaya")], (1, 2))
    for model, check in (("Mamba-2", mamba2), ("Zaya", zaya)):
        assert check.wrong == [], f"{model}: " + "; ".join(map(str, check.wrong[:3]))
        assert check.checked > 1000 and check.nodes > 500, (model, check.checked, check.nodes)
    assert mamba2.ops["aten.cumsum.default"] >= 2
    assert zaya.ops["aten.linalg_vector_norm.default"] >= 1
