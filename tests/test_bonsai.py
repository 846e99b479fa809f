"""Bonsai (issue 24): the regression recovers a known additive importance exactly, the rounds shrink the alive
units to the target, and a run on the tiny model lands on its budget with forward passes only."""

from __future__ import annotations

import json

import pytest
import torch

from engine.algo.methods.bonsai import alive_targets, regression_importance


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_regression_recovers_an_additive_importance_exactly(seed):
    """loss(m) = sum_i a_i (1 - m_i): removing unit i costs a_i. On sub-models sampled at 70 % the ridge
    regression ranks the units exactly as a does, and its coefficients are a (small ridge, no noise)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(12, generator=g, dtype=torch.float64) * 3
    masks = (torch.rand(200, 12, generator=g) < 0.7).double()
    losses = ((1 - masks) * a).sum(1) + 2.0
    importance = regression_importance(masks, losses, ridge=1e-6)
    assert torch.equal(torch.argsort(importance), torch.argsort(a))
    torch.testing.assert_close(importance, a, rtol=1e-4, atol=1e-4)


def test_the_rounds_shrink_the_alive_units_to_the_target():
    targets = alive_targets({"kv_groups": 90, "channels": 46080}, keep=0.7, rounds=5)
    assert [t["kv_groups"] for t in targets] == [85, 79, 74, 68, 63]  # 90 - 27 r / 5, rounded
    assert targets[-1]["channels"] == round(46080 * 0.7)
    assert all(a["channels"] > b["channels"] for a, b in zip(targets, targets[1:]))


def test_bonsai_runs_on_the_budget_with_forward_passes_only(tiny, tiny_path, small_eval_file, tmp_path):
    from test_methods import run_tiny

    results = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", method="bonsai", steps=6, num_mask_samples=4,
                       method_options={"rounds": 3})
    assert results["method"] == "bonsai" and results["steps"] == 6 and results["final_mask"] == "last"
    assert abs(results["removed_of_decoder"] - 0.3) < 0.02
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(len(x["losses"]) == 4 for x in lines)  # N_s masked forwards a step, like PG
    assert all(p.grad is None for p in tiny[0].parameters())
    masks = json.loads((tmp_path / "r" / "masks.json").read_text())
    assert masks["kept_per_layer"] == results["kept_per_layer"]


def test_bonsai_options_are_checked():
    from engine.settings.config import PruneConfig
    from engine.errors import UserError

    with pytest.raises(UserError, match="one step per round"):
        PruneConfig(method="bonsai", steps=3, method_options={"rounds": 5}).validate()
    with pytest.raises(UserError, match="ridge"):
        PruneConfig(method="bonsai", method_options={"ridge": 0.0}).validate()


def test_the_progress_line_counts_rounds_and_samples():
    from engine.algo.methods import METHODS

    config = {"method": "bonsai", "steps": 10, "num_mask_samples": 8, "method_options": {"rounds": 5}}
    bonsai = METHODS["bonsai"]
    assert bonsai.progress(config, 0) == "round 1 of 5: 0 sub-models sampled in it"
    assert bonsai.progress(config, 1) == "round 1 of 5: 8 sub-models sampled in it"
    assert bonsai.progress(config, 2) == "round 2 of 5: 0 sub-models sampled in it"
    assert bonsai.progress(config, 9) == "round 5 of 5: 8 sub-models sampled in it"
    assert METHODS["pg"].progress(config, 3) is None
