"""--early-stop N (issue 28): a run whose hard mask has stopped changing and whose scores are saturated ends
early, unless its validation is still improving."""

from __future__ import annotations

import torch

from engine.algo.context import KEEP
from engine.hooks.early_stop import saturated, still
from engine.run.masks import mask_key
from engine.hooks.validation import Validation
from engine.run.loop import PruneRun

from test_pruner import small_config


def test_saturated_allows_one_percent_in_between():
    sure = torch.cat([torch.zeros(500), torch.ones(495)])
    assert saturated({"a": torch.cat([sure, torch.full((5,), 0.5)])})  # 0.5 % in between
    assert not saturated({"a": torch.cat([sure, torch.full((20,), 0.5)])})
    assert saturated({"a": torch.tensor([0.005, 0.995])})


def test_still_needs_all_three():
    assert still(10, 10, True, best_step=5, step=20, validates=True)
    assert not still(9, 10, True, best_step=5, step=20, validates=True)  # the mask moved 9 steps ago
    assert not still(10, 10, False, best_step=5, step=20, validates=True)  # scores still soft
    assert not still(10, 10, True, best_step=15, step=20, validates=True)  # validation improved 5 steps ago
    assert still(10, 10, True, best_step=None, step=20, validates=False)


def test_never_fires_while_validation_improves_on_a_synthetic_sequence():
    """Each check better than the last: at no step does the rule stop the run, however long the mask is still."""
    best, fired = None, []
    for step in range(1, 200):
        best = step  # every step's check improves on the best
        fired.append(still(unchanged=step, patience=5, is_saturated=True, best_step=best, step=step, validates=True))
    assert not any(fired)


def test_the_mask_key_follows_the_hard_mask():  # (what early stopping compares from step to step)
    a = {"kv_groups": torch.tensor([0.9, 0.2]), "channels": torch.tensor([0.7, 0.6, 0.1])}
    b = {"kv_groups": torch.tensor([0.8, 0.1]), "channels": torch.tensor([0.9, 0.51, 0.3])}
    assert mask_key(a, KEEP) == mask_key(b, KEEP)
    b["channels"][1] = 0.4
    assert mask_key(a, KEEP) != mask_key(b, KEEP)


def saturating_config(tiny_path, eval_file, **kw):
    # a huge learning rate pins every score to 0 or 1 within a step or two: the hard mask then stands still
    return small_config(tiny_path, eval_file, steps=40, lr=1e4, early_stop=3, checkpoint_every=1000, **kw)


def test_a_run_that_stands_still_stops(tiny, tiny_path, small_eval_file, tmp_path):
    logs = []
    config = saturating_config(tiny_path, small_eval_file, val_every=0, final_mask="last")
    results = PruneRun(config, tmp_path / "r", model=tiny[0], tokenizer=tiny[1], log=logs.append).run(progress=False)
    assert results["stopped_early"] is not None and results["steps"] == results["stopped_early"] < 40
    assert any("stopping early" in m for m in logs)
    config = small_config(tiny_path, small_eval_file, steps=12, lr=1e4, early_stop=0, val_every=0, final_mask="last")
    off = PruneRun(config, tmp_path / "off", model=tiny[0], tokenizer=tiny[1], log=lambda m: None).run(progress=False)
    assert off["steps"] == 12 and off["stopped_early"] is None


def test_a_run_still_improving_on_validation_is_not_stopped(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """The same standing-still run, but its held-out checks keep improving (a synthetic validation whose every
    check beats the last): it runs all its steps."""
    calls = []

    def improving(self, state):
        calls.append(state.step)
        ppl = 1000.0 - len(calls)
        state.hooks.setdefault("validation", {}).update(best_val=ppl, best_step=state.step,
                                                        best_scores={u: s.clone() for u, s in state.scores.items()})
        return ppl

    monkeypatch.setattr(Validation, "validate", improving)
    config = saturating_config(tiny_path, small_eval_file, val_every=1)
    results = PruneRun(config, tmp_path / "r", model=tiny[0], tokenizer=tiny[1], log=lambda m: None).run(progress=False)
    assert results["steps"] == 40 and results["stopped_early"] is None
