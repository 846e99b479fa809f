"""pg-alloc (engine/algo/methods/alloc.py): policy gradient over one logit offset per (unit type, layer). Its pure parts
(offsets to units, the estimator on a quadratic, antithetic pairs, the scale-free step), and runs of the tiny model:
mu = 0 is the start's mask, every sampled and the final mask are the budget's cut and keep each layer's order, the
final mask is the cut of s(mu) (no projection moves it), a stopped and resumed run equals an uninterrupted one,
and bad options are one error line."""

from __future__ import annotations

import json

import math
import threading

import pytest
import torch
from safetensors.torch import load_file

from engine.algo.budget import unit_weights
from engine.settings.config import PruneConfig
from engine.run.initialise import fresh_state
from engine.algo.methods.alloc import (within_radius, antithetic_offsets, expand_offsets, learned_layers, offset_gradient, offset_index,
                                  scale_free_step, shifted_scores)
from engine.run.loop import PruneRun
from engine.model.unit_types import UNIT_TYPES

from conftest import SMALL_CALIB, TINY_MODEL, one_error, quiet

SIZES = {"layers": [1, 1, 1], "kv_groups": [2, 2, 2], "channels": [3, 3, 3]}


# --- the pure parts ---------------------------------------------------------------------------------------------
def test_offsets_are_learned_where_they_can_change_a_mask_and_expand_to_their_units():
    scores = {"layers": torch.tensor([1.0, 0.0, 1.0]),  # fixed layers (0/1): no layer offset; layer 1 removed
              "kv_groups": torch.tensor([0.3, 0.7, 0.4, 0.6, 1.0, 1.0]),  # layer 2's heads saturated: no offset
              "channels": torch.tensor([0.2, 0.5, 1.0, 0.5, 0.5, 0.5, 0.0, 0.9, 0.8])}
    learned = learned_layers(scores, SIZES)
    assert learned["layers"].tolist() == [False, False, False]
    assert learned["kv_groups"].tolist() == [True, False, False]  # (layer 1: removed whole)
    assert learned["channels"].tolist() == [True, False, True]
    index = offset_index(SIZES, learned)
    assert index["layers"].tolist() == [-1, -1, -1]
    assert index["kv_groups"].tolist() == [0, 0, -1, -1, -1, -1]
    assert index["channels"].tolist() == [1, 1, 1, -1, -1, -1, 2, 2, 2]
    mu = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    per_unit = expand_offsets(mu, index)
    assert per_unit["channels"].tolist() == [-1.0] * 3 + [0.0] * 3 + [2.0] * 3
    base = {u: torch.logit(s.double()) for u, s in scores.items()}
    s = shifted_scores(base, index, mu)
    torch.testing.assert_close(s["kv_groups"][:2], torch.sigmoid(torch.logit(torch.tensor([0.3, 0.7], dtype=torch.float64)) + 0.5))
    assert s["layers"].tolist() == [1.0, 0.0, 1.0] and s["kv_groups"][4:].tolist() == [1.0, 1.0]  # saturated stay
    assert s["channels"][6] == 0.0 and s["channels"][2] == 1.0
    torch.testing.assert_close(shifted_scores(base, index, torch.zeros(3, dtype=torch.float64))["channels"],
                               scores["channels"].double())


def test_antithetic_offsets_come_in_pairs_around_mu_and_repeat_with_the_generator():
    mu = torch.tensor([0.3, -0.2, 1.0], dtype=torch.float64)
    b = antithetic_offsets(mu, 0.5, 6, torch.Generator().manual_seed(7))
    assert b.shape == (6, 3)
    torch.testing.assert_close(b[0::2] + b[1::2], 2 * mu.expand(3, 3))
    assert not torch.allclose(b[0], b[2])  # pairs differ
    assert torch.equal(b, antithetic_offsets(mu, 0.5, 6, torch.Generator().manual_seed(7)))
    with pytest.raises(ValueError, match="even"):
        antithetic_offsets(mu, 0.5, 3, torch.Generator())


def test_the_estimator_points_downhill_on_a_quadratic_loss():
    """L(b) = |b - t|^2: d E[L] / d mu = 2 (mu - t). The antithetic estimate's mean over many steps is that gradient
    (within its noise); a baseline equal within each pair (the step's mean loss) changes no estimate; the
    scale-free step lowers the loss."""
    g = torch.Generator().manual_seed(0)
    mu, t, sigma = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64), 0.5
    true, est, n = 2 * (mu - t), torch.zeros(4, dtype=torch.float64), 3000
    for _ in range(n):
        b = antithetic_offsets(mu, sigma, 8, g)
        losses = ((b - t) ** 2).sum(1)
        one = offset_gradient(b, mu, sigma, losses, float(losses.mean()))
        torch.testing.assert_close(one, offset_gradient(b, mu, sigma, losses))  # the baseline cancels in each pair
        est += one / n
    assert float(est @ true) > 0.99 * float(est.norm() * true.norm())  # the same direction
    torch.testing.assert_close(est, true, rtol=0.05, atol=0.1)
    step = scale_free_step(mu, true, 0.1)
    assert float(((step - t) ** 2).sum()) < float(((mu - t) ** 2).sum())
    assert math.isclose(float((step - mu).pow(2).mean().sqrt()), 0.1)  # moved by the step size, in rms
    assert torch.equal(scale_free_step(mu, torch.zeros(4, dtype=torch.float64), 0.1), mu)  # no signal: no move


# --- runs of the tiny model -------------------------------------------------------------------------------------
JOINT = dict(units=["layers", "kv_groups", "channels"], layer_init="layerwise-ppl", layer_score_const=1.0)  # the joint preset
CASES = {"params": {}, "units": dict(budget="units"), "joint": JOINT}


def alloc_config(eval_file, **kw) -> PruneConfig:
    base = dict(model=str(TINY_MODEL), method="pg-alloc", steps=3, batch_size=2, seqlen=32, eval_seqlen=32,
                max_windows=2, init_batches=1, num_mask_samples=4, calib=str(SMALL_CALIB), eval_data=str(eval_file),
                checkpoint_every=1, final_mask="last", val_every=0, method_options={"step": 1.0})
    return PruneConfig.of(**{**base, **kw})


def spied_run(config, tiny, out=None) -> tuple[PruneRun, dict]:
    """A run whose sampled masks and state are recorded: seen["samples"] (one dict per step), seen["state"]."""
    run = PruneRun(config, out, model=tiny[0], tokenizer=tiny[1], log=quiet)
    seen = {"samples": []}
    rewards, next_scores = run.res.ctx.rewards, run.res.method.next_scores

    def record_rewards(samples, batch, *a):
        seen["samples"].append({u: m.clone() for u, m in samples.items()})
        return rewards(samples, batch, *a)

    def record_state(state, grads, lr):
        seen["state"] = state
        return next_scores(state, grads, lr)

    run.res.ctx.rewards, run.res.method.next_scores = record_rewards, record_state
    return run, seen


def kept_params(run, masks) -> float:
    """The kept parameters of the pruned units (a removed layer's widths not counted twice)."""
    if hasattr(run.res.budget, "kept_params"):
        return run.res.budget.kept_params(masks)
    w = unit_weights(run.res.adapter, run.res.layout)
    return float(sum((w[u] * (m > 0.5)).sum() for u, m in masks.items()))


def assert_on_budget(run, masks, reference):
    """Unit budget: every type keeps exactly the reference's count. Parameter budget: the kept parameters are at
    most the target and within one unit's weight of it, as the reference's are."""
    if run.res.config.budget == "units":
        assert {u: int((m > 0.5).sum()) for u, m in masks.items()} == {u: int((m > 0.5).sum()) for u, m in reference.items()}
        return
    target = run.res.budget.kept_target(run.res.config.keep_ratio)
    heaviest = max(float(w.max()) for u, w in unit_weights(run.res.adapter, run.res.layout).items() if not UNIT_TYPES[u].whole_layer)
    for m in (masks, reference):
        assert target - heaviest < kept_params(run, m) <= target + 1e-6


def assert_layer_order_kept(run, masks, start):
    """Inside every (type, layer), a kept unit implies every unit of that layer with a higher start score is kept."""
    for u, m in masks.items():
        for keep, s in zip(run.res.layout.split(u, m > 0.5), run.res.layout.split(u, start[u].double())):
            if bool(keep.any()):
                assert bool(keep[s > float(s[keep].min())].all()), u


@pytest.mark.parametrize("case", sorted(CASES))
def test_mu_zero_is_the_start_mask(case, tiny, eval_file):
    run = PruneRun(alloc_config(eval_file, **CASES[case]), None, model=tiny[0], tokenizer=tiny[1], log=quiet)
    state = fresh_state(run.res, run.call_hooks)
    start = dict(state.scores)
    run.res.method._start(state)
    at_zero = run.res.ctx.hard_masks(run.res.method.scores(state))
    want = run.res.ctx.hard_masks(start)
    assert all(torch.equal(at_zero[u], want[u]) for u in want), case
    if case == "joint":  # the fixed layers carry no offset, nor the widths of a removed layer
        removed = [i for i, p in enumerate(start["layers"].tolist()) if p == 0.0]
        index = state.method_state["alloc"]["index"]
        assert removed and bool((index["layers"] == -1).all())
        assert all(bool((run.res.layout.split(u, index[u])[i] == -1).all()) for u in ("kv_groups", "channels") for i in removed)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_sample_and_the_final_mask_are_the_budget_cut_in_the_start_order(case, tiny, eval_file):
    run, seen = spied_run(alloc_config(eval_file, **CASES[case]), tiny)
    results = run.run(progress=False)
    state = seen["state"]
    m = state.method_state["alloc"]
    start = {u: torch.sigmoid(b) for u, b in m["base"].items()}
    init = run.res.ctx.hard_masks(start)
    assert len(seen["samples"]) == 3 and float(m["mu"].abs().sum()) > 0  # (3 steps, and mu moved)
    distinct = set()
    for samples in seen["samples"]:
        for j in range(4):
            mask = {u: x[j] for u, x in samples.items()}
            assert_on_budget(run, mask, init)
            assert_layer_order_kept(run, mask, start)
            distinct.add(tuple((x[j] > 0.5).numpy().tobytes() for x in samples.values()))
    assert len(distinct) > 1  # the offsets' noise moves the cut
    final = results["masks"]
    want = run.res.ctx.hard_masks(shifted_scores(m["base"], m["index"], m["mu"]))  # the last mu's cut: nothing moved it
    assert all(torch.equal(final[u], want[u].to(final[u].dtype)) for u in want)
    assert all(torch.equal(state.scores[u], s) for u, s in run.res.method.scores(state).items())  # the view, unprojected
    assert_on_budget(run, final, init)
    assert_layer_order_kept(run, final, start)


def test_a_stopped_and_resumed_run_equals_an_uninterrupted_one(tiny, eval_file, tmp_path):
    config = alloc_config(eval_file, units=["kv_groups", "channels"], reward="kl")
    a, b = tmp_path / "A", tmp_path / "B"
    PruneRun(config, a, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    stop = threading.Event()
    first = PruneRun(config, b, model=tiny[0], tokenizer=tiny[1], log=quiet).run(
        progress=False, stop=stop, observer=lambda r: stop.set() if r.step == 2 else None)
    assert first["status"] == "stopped" and first["step"] == 2
    PruneRun(PruneConfig.load(b / "config.json"), b, model=tiny[0], tokenizer=tiny[1], log=quiet).run(
        resume=True, progress=False)
    ta, tb = load_file(str(a / "masks.safetensors")), load_file(str(b / "masks.safetensors"))
    assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    mu = [torch.load(x / "checkpoint.pt", weights_only=False)["method_state"]["alloc"]["mu"] for x in (a, b)]
    assert torch.equal(mu[0], mu[1]) and float(mu[0].abs().sum()) > 0
    lines = [[ln for ln in (x / "metrics.jsonl").read_text().splitlines()] for x in (a, b)]
    strip = lambda ln: {k: v for k, v in __import__("json").loads(ln).items() if k not in ("seconds", "eta_seconds")}  # noqa: E731
    assert [strip(x) for x in lines[0]] == [strip(x) for x in lines[1]] and len(lines[0]) == 3


def test_step_refit_scores_every_sample_refit(tiny, eval_file):
    run, seen = spied_run(alloc_config(eval_file, steps=1, step_refit=True, reconstruct=True), tiny)
    calls = []
    weights = run.res.ctx.weights
    run.res.ctx.weights = lambda masks: calls.append(masks) or weights(masks)
    run.run(progress=False)
    assert len(calls) == 4  # one refit a sample


@pytest.mark.parametrize("flags, needle", [
    (["--alloc-sigma", "0"], "sigma must be above 0"),
    (["--alloc-step", "-1"], "step must be above 0"),
    (["--alloc-radius", "0"], "radius must be above 0"),
    (["--num-mask-samples", "3"], "antithetic pairs: num mask samples must be even, got 3"),
    (["--init", "random-progressive"], "random-progressive"),
    (["--lr", "0.01"], "pg-alloc's step is scale-free: --lr 0.01 would change nothing"),
])
def test_bad_options_are_one_error_line(flags, needle, capfd, tmp_path):
    from engine.cli import main

    argv = ["prune", "--model", str(TINY_MODEL), "--method", "pg-alloc", *flags, "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    one_error(capfd, needle)


def test_the_learning_rate_cancels_out_of_the_steps_which_is_why_it_is_refused(tiny, eval_file):
    """next_scores reads the rate only as this step's over the first step's: a run whose every step is handed a
    quarter of the rate takes the same steps (so a --lr that is not the default is refused, above, not ignored)."""
    mus = []
    for factor in (1.0, 0.25):
        run, seen = spied_run(alloc_config(eval_file, steps=2, lr_schedule="cosine"), tiny)
        step = run.res.method.next_scores
        run.res.method.next_scores = lambda state, grads, lr, step=step, f=factor: step(state, grads, lr * f)
        run.run(progress=False)
        mus.append(seen["state"].method_state["alloc"]["mu"].clone())
    assert float(mus[0].abs().sum()) > 0 and torch.equal(mus[0], mus[1])


def test_an_alloc_flag_needs_the_method(capfd, tmp_path):
    from engine.cli import main

    assert main(["prune", "--model", str(TINY_MODEL), "--method", "pg", "--alloc-sigma", "0.3",
                 "--out", str(tmp_path / "r")]) == 2
    one_error(capfd, "--alloc-sigma applies to --method pg-alloc")


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_two_ranks_give_the_single_process_run_bit_for_bit(eval_file, tmp_path):
    """The default preset (the joint: pg-alloc, --reward kl, --step-refit): each rank refits and scores its share
    of the 4 samples; masks, mu and every report equal the one-process run's."""
    from test_distributed import checkpoint, one_and_two_ranks

    one, two, _ = one_and_two_ranks(eval_file, tmp_path, 3, ["--method", "pg-alloc", "--num-mask-samples", "4",
                                                             "--reward", "kl", "--step-refit", "--lr", "0.02"])
    # (--lr 0.02: the shared flags' 0.05 is pg's, and pg-alloc refuses a rate other than the default)
    assert json.loads((two / "config.json").read_text())["step_refit"] is True
    assert float(checkpoint(two)["method_state"]["alloc"]["mu"].abs().sum()) > 0


def test_the_trust_region_scales_the_offsets_back_onto_its_ball_and_leaves_them_inside_it():
    """--alloc-radius R (issue 64's trust-region candidate): offsets whose root mean square is above R are scaled
    back to R, in the same direction; inside the ball, or without a radius, they stay as they are."""
    mu = torch.tensor([0.3, -0.4, 0.0, 0.5], dtype=torch.float64)
    rms = float(mu.pow(2).mean().sqrt())
    out = within_radius(mu, 0.1)
    assert float(out.pow(2).mean().sqrt()) == pytest.approx(0.1)
    assert torch.allclose(out / out.norm(), mu / mu.norm())
    assert within_radius(mu, rms + 1e-9) is mu and within_radius(mu, None) is mu
    assert within_radius(torch.zeros(0, dtype=torch.float64), 0.1).numel() == 0
