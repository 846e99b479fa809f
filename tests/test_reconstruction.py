"""--reconstruct: the least-squares refit of the kept columns (engine/algo/reconstruction.py) against a direct
least-squares solve, its statistics against the ones the engine already takes, the refit projection's error
against the compensation's, and the run: its export equals its masked evaluation, it resumes as an
uninterrupted run, old configs load without it."""

from __future__ import annotations

import dataclasses

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.algo.context import KEEP
from engine.model.arch import ModelAdapter
from engine.settings.config import PruneConfig
from engine.export.artifacts import kept_indices
from engine.model.masking import MaskHooks
from engine.algo.metrics.activations import column_moments
from engine.run.loop import PruneRun
from engine.run.masks import mask_key
from engine.algo.reconstruction import _groups, input_moments, reconstructed, regression
from engine.model.unit_types import UNIT_TYPES, unit_sizes
from engine.model.units import UnitLayout

from test_adapters_export import build_model
from test_executors import batch
from test_pruner import assert_same_run, quiet, resume_run, small_config, stop_after


def moments_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.T @ x / len(x), x.mean(0)


@pytest.mark.parametrize("centered", [True, False])
def test_the_regression_is_the_least_squares_solution(centered):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 9, generator=g, dtype=torch.float64) @ torch.randn(9, 9, generator=g, dtype=torch.float64) + 2.0
    kept = torch.tensor([0, 2, 3, 7])
    removed = torch.tensor([1, 4, 5, 6, 8])
    a, f = regression(*moments_of(x), kept, ridge=0.0, centered=centered)
    design = torch.cat([x[:, kept], torch.ones(len(x), 1, dtype=x.dtype)], 1) if centered else x[:, kept]
    want = torch.linalg.lstsq(design, x[:, removed]).solution
    torch.testing.assert_close(a, want[:len(kept)].T, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(f, want[len(kept)] if centered else torch.zeros(len(removed), dtype=x.dtype),
                               rtol=1e-8, atol=1e-8)


def test_a_large_ridge_leaves_the_means_the_compensation_fills_in():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 6, generator=g, dtype=torch.float64) + torch.arange(6.0, dtype=torch.float64)
    kept = torch.tensor([1, 4])
    a, f = regression(*moments_of(x), kept, ridge=1e9)
    assert a.abs().max() < 1e-6
    torch.testing.assert_close(f, x.mean(0)[[0, 2, 3, 5]], rtol=1e-5, atol=1e-5)


def test_layer_groups_fit_the_memory_cap_in_order():
    sizes = [5, 3, 4, 9, 1, 1, 2]
    groups = _groups(sizes, 8)
    assert [i for grp in groups for i in grp] == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in grp) <= 8 or len(grp) == 1 for grp in groups)
    assert groups == [[0, 1], [2], [3], [4, 5, 6]]


def test_the_statistics_agree_with_the_engines_column_moments_in_one_pass_or_several():
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    batches = [batch(model, rows=2, seqlen=13, seed=s) for s in (1, 2)]
    one = input_moments(a, batches, ["kv_groups", "channels"])
    several = input_moments(a, batches, ["kv_groups", "channels"], max_bytes=1)  # one projection a pass
    sums, squares, tokens = column_moments(a, batches)
    for key, (second, total, n) in one.items():
        assert n == tokens
        torch.testing.assert_close(total.float(), sums[key], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(second.diagonal().float(), squares[key], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(several[key][0], second, rtol=0, atol=0)



def test_a_stop_rule_ends_the_statistics_early_in_every_pass():
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    batches = [batch(model, rows=2, seqlen=13, seed=s) for s in (1, 2, 3, 4)]
    asked = []
    stop = lambda done: asked.append(done) or done >= 2  # noqa: E731
    for max_bytes in (2 << 30, 1):  # one pass, or one pass per projection (the later passes run as many)
        asked.clear()
        early = input_moments(a, batches, ["kv_groups", "channels"], max_bytes=max_bytes, stop=stop)
        first_two = input_moments(a, batches[:2], ["kv_groups", "channels"], max_bytes=max_bytes)
        assert asked == [1, 2]
        for key, (second, total, n) in early.items():
            assert n == first_two[key][2] == sum(b.numel() for b in batches[:2])
            torch.testing.assert_close(second, first_two[key][0], rtol=0, atol=0)
            torch.testing.assert_close(total, first_two[key][1], rtol=0, atol=0)


def _recorded(model, proj, ids):
    got = []
    h = proj.register_forward_hook(lambda m, args, out: got.append(out.detach().reshape(-1, out.shape[-1])))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    return got[0].double()


@pytest.mark.parametrize("unit", ["kv_groups", "channels"])
def test_the_refit_projection_matches_the_dense_one_best_and_the_weights_come_back(unit):
    """One layer pruned (the projection's input is then the dense model's): on the statistics' own tokens the
    refit output is the least-squares fit of the dense output, no worse than the compensation's mean comp_means, and
    equal to a direct least-squares solve; leaving the context restores every weight bit for bit."""
    model = build_model("mistral")
    a = ModelAdapter.for_model(model)
    layout = UnitLayout({unit: unit_sizes(a)[unit]})
    ids = batch(model, rows=6, seqlen=31, seed=3)
    moments = input_moments(a, [ids], [unit])
    n = layout.sizes[unit][0]
    mask = torch.ones(layout.total(unit))
    mask[: n // 3] = 0.0  # layer 0 loses its first third
    masks = {unit: mask}
    t = UNIT_TYPES[unit]
    proj = t.output_proj(a, 0)
    dense_out = _recorded(model, proj, ids)
    inputs = []
    h = proj.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    x = inputs[0].double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    second, total, tokens = moments[(unit, 0)]
    mean_fill = {unit: [total.float() / tokens if i == 0 else torch.zeros_like(total.float()) for i in range(a.num_layers)]}

    def masked_out(comp_means):
        with MaskHooks(a) as hooks:
            hooks.set({unit: layout.split(unit, mask)}, comp_means)
            return _recorded(model, proj, ids)

    err_mean = (masked_out(mean_fill) - dense_out).pow(2).sum()
    with reconstructed(a, layout, masks, moments, ridge=0.0) as comp_means:
        refit = masked_out(comp_means)
    err_ls = (refit - dense_out).pow(2).sum()
    assert err_ls < err_mean
    cols = t.column_index(a, torch.nonzero(layout.split(unit, mask)[0]).flatten())
    design = torch.cat([x[:, cols], torch.ones(len(x), 1, dtype=x.dtype)], 1)
    bias = proj.bias.double() if proj.bias is not None else 0.0
    solution = torch.linalg.lstsq(design, dense_out - bias).solution
    torch.testing.assert_close(refit, design @ solution + bias, rtol=1e-4, atol=1e-4)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# --- runs on the tiny real model -------------------------------------------------------------------------
def _run(tiny, tiny_path, small_eval_file, out, **kw):
    config = small_config(tiny_path, small_eval_file, reconstruct_batches=2, **kw)
    return PruneRun(config, out, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)


@pytest.mark.parametrize("compensation", [True, False], ids=["with-intercept", "through-origin"])
def test_a_reconstructed_run_exports_what_it_evaluated(compensation, tiny, tiny_path, small_eval_file, tmp_path):
    plain = _run(tiny, tiny_path, small_eval_file, tmp_path / "plain", method="metric", bias_compensation=compensation)
    before = {k: v.clone() for k, v in tiny[0].state_dict().items()}
    results = _run(tiny, tiny_path, small_eval_file, tmp_path / "r", method="metric", reconstruct=True,
                   bias_compensation=compensation, eval_unrefit=True)
    for k, v in tiny[0].state_dict().items():  # the run's model is left as it was given
        assert torch.equal(v, before[k]), k
    r = results["reconstruction"]
    assert r["ppl_before"] == pytest.approx(plain["ppl_pruned"]) and r["intercept"] == compensation
    assert results["ppl_pruned"] != pytest.approx(plain["ppl_pruned"])  # the refit changed the model
    assert results["kept_per_layer"] == plain["kept_per_layer"] and results["params_pruned"] == plain["params_pruned"]
    from engine.algo.evaluate import perplexity

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "r" / "model", trust_remote_code=True).eval()
    run = PruneRun(PruneConfig.load(tmp_path / "r" / "config.json"), tmp_path / "x", model=tiny[0], tokenizer=tiny[1], log=quiet)
    assert perplexity(exported, run.res.windows) == pytest.approx(results["ppl_pruned"], rel=1e-4)
    assert json.loads((tmp_path / "r" / "results.json").read_text())["reconstruction"] == r


def test_a_reconstructed_run_resumes_as_an_uninterrupted_one(tiny, tiny_path, small_eval_file, tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    results_a = _run(tiny, tiny_path, small_eval_file, a, reconstruct=True)
    stop_after(small_config(tiny_path, small_eval_file, reconstruct_batches=2, reconstruct=True), b, tiny, 3)
    results_b = resume_run(b, tiny)
    assert_same_run(a, b, results_a, results_b)
    assert results_b["reconstruction"] == results_a["reconstruction"]


def test_old_configs_load_without_it_new_ones_with_it_and_layers_alone_have_nothing_to_refit(
        tiny, tiny_path, small_eval_file, tmp_path):
    old = small_config(tiny_path, small_eval_file).to_dict()
    for key in ("reconstruct", "reconstruct_batches", "reconstruct_ridge"):
        old.pop(key)
    assert PruneConfig.from_dict(old).reconstruct is False  # a run from before it, resumed or shown, as it ran
    assert PruneConfig().reconstruct is True  # the CLI's and the App's default
    results = _run(tiny, tiny_path, small_eval_file, tmp_path / "L", units=["layers"], layer_init="layerwise-ppl",
                   method="metric", reconstruct=True, budget="params")
    assert "reconstruction" not in results


def _joint_run_seeing_mix_losses(tiny, tiny_path, small_eval_file, out, monkeypatch, see, mix_refit: bool):
    """A joint run with --reconstruct whose every mix-candidate loss first calls see(run, masks, comp_means, dense), dense
    the model's state before the run; (what see returned, in order; the run's results)."""
    import engine.run.mix as joint

    dense = {k: v.clone() for k, v in tiny[0].state_dict().items()}
    seen = []
    real = joint.hard_mask_loss

    def spy(run, masks, batch, comp_means=KEEP, **kw):
        seen.append(see(run, masks, comp_means, dense))
        return real(run, masks, batch, comp_means, **kw)

    monkeypatch.setattr(joint, "hard_mask_loss", spy)
    results = _run(tiny, tiny_path, small_eval_file, out, method="flap", units=["layers", "kv_groups", "channels"],
                   layer_init="layerwise-ppl", reconstruct=True, mix_refit=mix_refit, mix_batches=2, budget="params",
                   prune_ratio=0.5, eval_unrefit=True)
    for k, v in tiny[0].state_dict().items():
        assert torch.equal(v, dense[k]), k
    return seen, results


def test_the_joint_mix_is_chosen_on_refit_candidates_with_mix_refit(tiny, tiny_path, small_eval_file, tmp_path,
                                                                    monkeypatch):
    """With --mix-refit every joint-mix candidate is scored with its own kept columns refit (the weights differ
    from the dense ones while its losses are taken exactly when a kept layer lost width, with the refit's comp_means),
    and the weights come back after."""
    def see(res, masks, comp_means, dense):
        changed = any(not torch.equal(v, dense[k]) for k, v in res.model.state_dict().items())
        cut = any(len(kept[u]) < res.layout.sizes[u][i] for i, kept in kept_indices(res.layout, masks, res.adapter)
                  for u in ("kv_groups", "channels"))  # (a kept layer lost width: something to refit)
        return changed == cut and isinstance(comp_means, dict)

    seen, results = _joint_run_seeing_mix_losses(tiny, tiny_path, small_eval_file, tmp_path / "j", monkeypatch, see, True)
    assert seen and all(seen)
    assert results["init_mix"] and "reconstruction" in results


def test_a_refit_run_evaluates_its_final_mask_before_the_refit_only_when_asked(tiny, tiny_path, small_eval_file,
                                                                               tmp_path):
    """Issue 65: the unrefit final mask's perplexity (results.json's reconstruction.ppl_before) costs one more
    evaluation, as long as the pruned one, and nobody had asked for it: it comes with --eval-unrefit only, and the
    plan counts it only then."""
    from engine.plan.forecast import phase_tokens, skeleton_of

    lines = {}
    for flag in (False, True):
        seen = []
        config = small_config(tiny_path, small_eval_file, reconstruct_batches=2, method="metric", reconstruct=True,
                              eval_unrefit=flag)
        results = PruneRun(config, tmp_path / f"r{flag}", model=tiny[0], tokenizer=tiny[1], log=seen.append).run(progress=False)
        assert ("ppl_before" in results["reconstruction"]) == flag and results["reconstruction"]["batches"] == 2
        lines[flag] = [m for m in seen if "before reconstruction" in m]  # (evaluated, or the init mask's figure)
        no_init = dataclasses.replace(config, eval_init=False)  # (else the init mask's figure serves: one-shot)
        lines[flag, "plan"] = phase_tokens(no_init, skeleton_of(tiny[0]))["evaluations"]
    assert len(lines[True]) == 1 and not lines[False]
    assert lines[True, "plan"] > lines[False, "plan"]


def test_no_mix_refit_scores_the_candidates_on_the_dense_weights_and_still_refits_the_chosen_mask(
        tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """--no-mix-refit: every candidate's loss is taken on the unedited weights with the run's compensation (the
    comp_means the run measured, `...`), and the final mask is refit all the same (its perplexity differs from the same
    mask unrefit, which results.json keeps)."""
    def see(res, masks, comp_means, dense):
        return all(torch.equal(v, dense[k]) for k, v in res.model.state_dict().items()) and comp_means is KEEP

    seen, results = _joint_run_seeing_mix_losses(tiny, tiny_path, small_eval_file, tmp_path / "j", monkeypatch, see, False)
    assert seen and all(seen)
    assert results["init_mix"] and results["reconstruction"]["ppl_before"] != results["ppl_pruned"]


def test_step_refit_does_not_refit_the_mix_candidates_twice(tiny, tiny_path, small_eval_file, tmp_path):
    """--mix-refit with --step-refit: each candidate is scored under one refit, as with --mix-refit alone (the
    samples' own refit is not applied again on top of it); --step-refit alone leaves the mix unrefit. --mix-reward
    ce (the default preset's) scores the mix by cross-entropy whatever --reward the steps take."""
    def mix(name: str, **kw) -> list[dict]:
        return _run(tiny, tiny_path, small_eval_file, tmp_path / name, method="flap", units=["layers", "kv_groups", "channels"],
                    layer_init="layerwise-ppl", reconstruct=True, mix_batches=2, budget="params", prune_ratio=0.5,
                    **kw)["init_mix"]

    alone, both = mix("a", mix_refit=True), mix("b", mix_refit=True, step_refit=True)
    plain, steps_only = mix("c"), mix("d", step_refit=True)
    assert alone and both == alone and steps_only == plain
    ce, kl_by_ce, kl = mix("e", reward="ce"), mix("f", reward="kl", mix_reward="ce"), mix("g", reward="kl")
    assert kl_by_ce == ce and kl != ce


@pytest.mark.parametrize("val_refit", [True, False], ids=["refit", "unrefit"])
def test_best_val_validates_the_masks_as_the_run_would_export_them(val_refit, tiny, tiny_path, small_eval_file,
                                                                   tmp_path, monkeypatch):
    """--val-refit: every held-out check runs on the refit weights (the kept columns differ from the dense ones), and
    the init mask's held-out perplexity is the refit model's; --no-val-refit: on the dense weights. Either way the
    weights come back after each check."""
    from engine.algo.rewards import CrossEntropy

    edited = []
    real = CrossEntropy.held_out_means  # (the held-out check's forwards: --reward ce's)
    originals = [p.detach().clone() for p in tiny[0].parameters()]  # (while masked, the layers sit in gates)

    def spy(self, model, batches):
        edited.append(any(not torch.equal(p, o) for p, o in zip(model.parameters(), originals)))
        return real(self, model, batches)

    monkeypatch.setattr(CrossEntropy, "held_out_means", spy)
    results = _run(tiny, tiny_path, small_eval_file, tmp_path / "v", method="pg", init="flap", reconstruct=True,
                   val_refit=val_refit, val_every=3, steps=3, prune_ratio=0.5)
    assert edited and all(e == val_refit for e in edited)
    assert all(torch.equal(p, o) for p, o in zip(tiny[0].parameters(), originals))
    assert results["val_ppl_init"] > 1.0


def test_old_runs_validate_and_mix_as_they_did_when_resumed():
    """A run saved before --val-refit validated its masks unrefit: resumed, it goes on doing so (its best held-out
    perplexity so far is an unrefit one). One saved before --mix-refit scored its joint mix refit when it refit at
    all."""
    old = PruneConfig(reconstruct=True).to_dict()
    old.pop("val_refit")
    old.pop("mix_refit")
    assert PruneConfig.from_dict(old).val_refit is False
    assert PruneConfig.from_dict(old).mix_refit is True
    assert PruneConfig.from_dict({**old, "reconstruct": False}).mix_refit is False
    assert PruneConfig().val_refit is True and PruneConfig().mix_refit is False


def test_an_evaluation_cached_before_a_refit_is_still_cached_after_it(tiny, tiny_path, small_eval_file, tmp_path):
    """The refit sets the unedited weights' perplexities aside while the weights are edited (none of them is read
    there) and brings them back after: a mask evaluated before a validation's refit is not evaluated again."""
    config = small_config(tiny_path, small_eval_file, reconstruct_batches=2, method="pg", init="flap", reconstruct=True,
                          prune_ratio=0.5)
    run = PruneRun(config, tmp_path / "c", model=tiny[0], tokenizer=tiny[1], log=quiet)
    run.res.loop.progress = False
    masks = {u: torch.ones(run.res.layout.total(u)) for u in run.res.layout.unit_types}
    for u in masks:
        masks[u][::2] = 0  # (every other unit: each layer keeps some)
    before = run.res.masks.masked_perplexity(masks, "before")
    with run.res.masks.weights(masks) as comp_means:
        assert run.res.masks.measured == {}
        refit = run.res.masks.masked_perplexity(masks, "refit", comp_means)
    assert refit != before and run.res.masks.measured[mask_key(masks, KEEP)] == before
    assert len(run.res.masks.measured) == 1  # (the refit's own perplexity is gone with its weights)


def test_a_model_whose_statistics_would_not_fit_skips_the_refit_and_says_so(tiny, tiny_path, small_eval_file, tmp_path,
                                                                           monkeypatch):
    import engine.hooks.reconstruction as hook

    monkeypatch.setattr(hook, "available_memory", lambda: 1000)  # bytes: less than twice the tiny model's statistics
    plain = _run(tiny, tiny_path, small_eval_file, tmp_path / "plain", method="flap", reconstruct=False)
    results = _run(tiny, tiny_path, small_eval_file, tmp_path / "r", method="flap", reconstruct=True)
    assert "GiB available" in results["reconstruction"]["skipped"]
    assert results["ppl_pruned"] == plain["ppl_pruned"]


def test_an_offloaded_model_is_not_refit_and_says_why():
    """accelerate's offload (--device auto) leaves weights on `meta`: nothing to edit in place, so the hook skips."""
    from types import SimpleNamespace

    from engine.hooks.reconstruction import Reconstruction

    model = build_model("llama").to("meta")
    a = ModelAdapter.for_model(model)
    logs: list[str] = []
    run = SimpleNamespace(adapter=a, layout=UnitLayout({"kv_groups": unit_sizes(a)["kv_groups"]}), log=logs.append, config=None)
    hook = Reconstruction(run)
    hook.on_setup()
    assert "offloaded" in hook.skipped and any("reconstruction skipped" in m for m in logs)
    assert hook.results() == {"reconstruction": {"skipped": hook.skipped}}


def test_the_moments_gram_under_autocast_is_autocasts_own_product():
    """InputMoments casts a batch once under a bfloat16 autocast: its sums are the autocast products' float64
    sums, value for value; without autocast, float32's."""
    from engine.algo.reconstruction import InputMoments

    torch.manual_seed(0)
    xs = [torch.randn(96, 24) for _ in range(3)]
    for autocast in (True, False):
        reader = InputMoments(3, ["channels"])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for x in xs:
                reader.add("k", x)
            want = sum((x.T @ x).double() for x in xs)
        assert torch.equal(reader.acc["k"][0], want)
        assert torch.equal(reader.acc["k"][1], sum(x.sum(0).double() for x in xs))
