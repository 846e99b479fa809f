"""FLAP (issue 24): the fluctuation metric against a hand computation, its adaptive structure across layers
and modules, and its compensated export against the compensated masked model, on tiny random LLaMA, Mistral
and Qwen2 models; `--method flap` on the tiny real model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model.arch import ModelAdapter
from engine.algo.budget import ParamBudget
from engine.export.artifacts import export_pruned
from engine.model.masking import MaskHooks
from engine.algo.metrics import METRICS, MetricContext
from engine.algo.metrics.activations import input_means
from engine.algo.metrics.probability import initial_scores
from engine.model.unit_types import UNIT_TYPES, unit_sizes
from engine.model.units import UnitLayout

from test_adapters_export import ARCHS, build_model
from test_executors import batch


def flap_scores(model, batches, units=("kv_groups", "channels")):
    a = ModelAdapter.for_model(model)
    layout = UnitLayout({u: unit_sizes(a)[u] for u in units})
    raw = METRICS["flap"].fn(MetricContext(a, layout, batches), list(units))
    return a, layout, {u: torch.cat(raw[u]) for u in units}, raw


def recorded_inputs(model, proj, batches) -> torch.Tensor:
    """The inputs of module `proj` over the batches' tokens (tokens x columns), recorded by a hook on the dense model."""
    seen = []
    h = proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    h.remove()
    return torch.cat(seen)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_fluctuation_metric_equals_a_hand_computation(arch):
    """var over the calibration tokens of each output-projection input column (n - 1), times the column's
    squared norm, standardized per layer and module, averaged over a unit's columns."""
    model = build_model(arch)
    batches = [batch(model, rows=2, seqlen=11, seed=s) for s in (1, 2)]
    a, layout, _, raw = flap_scores(model, batches)
    for u in ("kv_groups", "channels"):
        t = UNIT_TYPES[u]
        for i in range(a.num_layers):
            proj = t.output_proj(a, i)
            x = recorded_inputs(model, proj, batches).double()
            score = x.var(0, unbiased=True) * proj.weight.detach().double().pow(2).sum(0)
            z = (score - score.mean()) / score.std()
            want = z.view(-1, t.column_width(a)).mean(1)
            torch.testing.assert_close(raw[u][i].double(), want, rtol=1e-4, atol=1e-5)


def test_the_adaptive_structure_gives_layers_their_own_widths():
    """Under one ranking across layers, a layer whose channel fluctuations are few and large (most of its
    channels then sit just below its mean) keeps another share of channels than a layer whose are spread;
    with the same statistics in every layer each layer would keep the same share."""
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    with torch.no_grad():  # layer 0: three channels carry almost all of the fluctuation
        w = a.mlp(0).output.weight
        w[:, :3] *= 50.0
    batches = [batch(model, rows=4, seqlen=16, seed=s) for s in (1, 2)]
    _, layout, z, _ = flap_scores(model, batches, units=("channels",))
    budget = ParamBudget(layout, "global", a)
    keep = 0.7
    s = budget.initial({"channels": initial_scores(z["channels"], layout, "channels", "global",
                                                   budget.type_keeps(keep)["channels"], "sigmoid-norm", 0.8)}, keep)
    kept = [int(m.sum()) for m in layout.split("channels", budget.hard_masks(s, keep)["channels"])]
    assert len(set(kept)) > 1, kept  # the layers got different widths
    assert kept[0] > max(kept[1:]), kept  # the skewed layer's bulk ranks above the others' low tails


def test_the_adaptive_structure_splits_the_budget_between_modules_by_one_ranking():
    model = build_model("llama")
    a, layout, z, _ = flap_scores(model, [batch(model, rows=4, seqlen=16, seed=1)])
    budget = ParamBudget(layout, "global", a)
    z["kv_groups"] = z["kv_groups"] + 5.0  # every KV group far above every channel: the channels take the whole cut
    keeps = budget.type_keeps(0.8, z)
    assert keeps["kv_groups"] == 1.0 and keeps["channels"] < 0.8
    assert budget.type_keeps(0.8, None)["kv_groups"] == pytest.approx(budget.type_keeps(0.8, None)["channels"])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_flap_compensated_export_equals_the_compensated_masked_model(arch, tmp_path, tiny):
    model = build_model(arch)
    batches = [batch(model, rows=4, seqlen=19, seed=5)]
    a, layout, z, _ = flap_scores(model, batches)
    budget, keep = ParamBudget(layout, "global", a), 0.7
    keeps = budget.type_keeps(keep, z)
    s = budget.initial({u: initial_scores(z[u], layout, u, "global", keeps[u], "sigmoid-norm", 0.8) for u in z}, keep)
    masks = budget.hard_masks(s, keep)
    assert budget.kept_params(masks) <= budget.kept_target(keep) + 1e-6
    comp_means = input_means(a, batches)
    ids = batch(model, rows=2, seqlen=19, seed=4)
    with torch.no_grad(), MaskHooks(a) as hooks:
        hooks.set({u: layout.split(u, m) for u, m in masks.items()}, comp_means)
        compensated = model(input_ids=ids).logits
    export_pruned(model, tiny[1], layout, masks, tmp_path / "m", comp_means)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, compensated, rtol=1e-4, atol=1e-4)


def test_method_flap_is_metric_flap_with_compensation(tiny, tiny_path, small_eval_file, tmp_path):
    from test_methods import run_tiny

    results = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", method="flap")
    assert results["method"] == "flap" and results["init"] == "flap" and results["steps"] == 0
    assert results["ppl_pruned"] == pytest.approx(results["ppl_init"])
    from engine.settings.config import PruneConfig

    saved = PruneConfig.load(tmp_path / "r" / "config.json")
    assert saved.bias_compensation and saved.init == "flap"
    assert abs(results["removed_of_decoder"] - 0.3) < 0.02


def test_a_compensated_flap_start_forwards_its_init_batches_once(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """FLAP's fluctuation and the compensation's means come from one pass over the init batches (the run's one
    statistics pass, engine/algo/statistics.py, with the refit's; the metric and the compensation read the run's memo),
    and the means equal the plain mean of each output-projection input column."""
    from engine.algo import statistics
    from engine.algo.metrics import activations
    from test_methods import run_tiny

    passes, forwards = [], []
    real, real_forward = activations.sums_per_batch, statistics.decoder_forward
    monkeypatch.setattr(activations, "sums_per_batch", lambda a, b, stat: passes.append(len(b)) or real(a, b, stat))
    monkeypatch.setattr(statistics, "decoder_forward", lambda m, b: forwards.append(1) or real_forward(m, b))
    run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", method="flap", init_batches=2, reconstruct=True, refit_stream="init",
             reconstruct_batches=3)
    assert passes == [] and len(forwards) == 3  # one pass: the metric's 2 batches are the first of the refit's 3

    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    batches = [batch(model, rows=2, seqlen=9, seed=s) for s in (3, 4)]
    memo: dict = {}
    means = input_means(a, batches, memo=memo)
    assert input_means(a, batches, memo=memo) is not None and len(passes) == 1  # the second call: no forward
    for u in ("kv_groups", "channels"):
        t = UNIT_TYPES[u]
        for i in range(a.num_layers):
            x = recorded_inputs(model, t.output_proj(a, i), batches)
            torch.testing.assert_close(means[u][i], x.mean(0), rtol=1e-5, atol=1e-6)
