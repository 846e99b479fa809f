"""engine/plan/forecast.py (a run's plan from the model's config, no weights) and the app's pure helpers in
engine/ui/settings.py and engine/ui/figures.py, tested directly on the tiny model."""

from __future__ import annotations

import pytest
import torch

from engine.algo.budget import removal_report
from engine.settings.config import PRESETS, PruneConfig
from engine.data.text import DEFAULT_EVAL_WINDOWS
from engine.errors import UserError
from engine.plan.forecast import (STEP_SAMPLE_WEIGHT, model_skeleton, phase_tokens, plan_memory, plan_removal, plan_time,
                         probe_seconds_per_token, rate_from_runs, scoring_tokens, skeleton_of, speedup)
from engine.ui import figures
from engine.ui import settings as S

from conftest import SMALL_CALIB, pg_config


@pytest.fixture(scope="module")
def skeleton(tiny_path):
    return model_skeleton(str(tiny_path))


def test_the_skeleton_has_the_loaded_models_shapes(skeleton, tiny):
    """Built on the meta device from config.json alone, it counts what the loaded model holds."""
    model, _ = tiny
    real = skeleton_of(model)
    assert next(skeleton.adapter.model.parameters()).device.type == "meta"
    assert skeleton.params_total == real.params_total == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert skeleton.num_layers == real.num_layers and skeleton.head_params == real.head_params


def test_a_model_that_cannot_be_read_is_one_user_error(tmp_path):
    with pytest.raises(UserError, match="holds no model"):
        model_skeleton(str(tmp_path))


@pytest.mark.parametrize("units,budget,scope,rate", [
    (["kv_groups", "channels"], "params", "global", 0.3),
    (["kv_groups", "channels"], "params", "uniform", 0.4),
    (["layers"], "params", "global", 0.3),
    (["kv_groups", "channels"], "units", "global", 0.5),
    (["channels"], "units", "uniform", 0.25),
])
def test_the_plan_removes_what_the_run_removes(tmp_path, tiny_path, skeleton, units, budget, scope, rate):
    """The plan's count against a real (2-step) run's results.json: equal within one unit's weight, and never
    under the budget."""
    from engine.run.loop import PruneRun

    config = PruneConfig(model=str(tiny_path), units=units, prune_ratio=rate, budget=budget, scope=scope, steps=2,
                         max_windows=2, init_batches=1, batch_size=2, seqlen=32, eval_seqlen=32, num_mask_samples=2,
                         val_batches=1, calib=str(SMALL_CALIB), layer_init="layerwise-ppl", layer_init_batches=1)
    plan = plan_removal(skeleton, units, rate, budget, scope, config.init)
    result = PruneRun(config, tmp_path / "run", log=lambda m: None).run(progress=False)
    assert result["params_decoder"] == plan.params_decoder and result["params_dense"] == plan.params_total
    assert abs(result["params_removed"] - plan.params_removed) <= max(plan.tolerance, 1), (result["params_removed"], plan)
    if budget == "params":
        assert plan.params_removed >= rate * plan.params_decoder - 1e-6
    if not (plan.split_learned or plan.split_from_metric):
        assert result["params_removed_by_unit_type"] == plan.by_type


def test_the_plan_uses_the_budgets_accounting(skeleton):
    """The same numbers as engine/algo/budget.py's removal_report on the same masks, and its refusals."""
    plan = plan_removal(skeleton, ["layers"], 0.5, "params", "global")
    layout_masks = {"layers": torch.tensor([1.0, 0.0])}
    from engine.model.units import UnitLayout

    report = removal_report(skeleton.adapter, UnitLayout({"layers": [1, 1]}), layout_masks, skeleton.params_total)
    assert plan.params_removed == report["params_removed"] and plan.layers_removed == 1
    with pytest.raises(UserError, match="lower --prune-ratio"):
        plan_removal(skeleton, ["kv_groups"], 0.95, "params", "global")  # more than the KV groups hold
    with pytest.raises(UserError, match="strictly between 0 and 1"):
        plan_removal(skeleton, ["kv_groups"], 1.0)


def test_speedup_grows_with_what_is_removed(skeleton):
    assert speedup(skeleton, 0) == 1.0
    small, large = (speedup(skeleton, plan_removal(skeleton, ["kv_groups", "channels"], r).params_removed) for r in (0.2, 0.5))
    assert 1.0 < small < large


def test_time_and_memory_follow_the_settings(skeleton, tiny_path):
    base = pg_config(model=str(tiny_path), steps=10, max_windows=4, init="taylor")
    more = pg_config(model=str(tiny_path), steps=20, max_windows=4, init="taylor")
    t1, t2 = (plan_time(c, skeleton, 1e-4, "test") for c in (base, more))
    assert t2.phases["steps"] == pytest.approx(2 * t1.phases["steps"])
    samples = 10 * base.num_mask_samples * base.batch_size * base.seqlen  # (masked forwards, each CE-scored)
    assert t1.phases["steps"] == pytest.approx((samples * STEP_SAMPLE_WEIGHT + scoring_tokens(skeleton, samples)) * 1e-4)
    assert not phase_tokens(PruneConfig(model=str(tiny_path), method="metric", init="wanda-sp"), skeleton)["steps"]
    sleb = phase_tokens(PruneConfig(model=str(tiny_path), units=["layers"], layer_init="sleb"), skeleton)
    assert sleb["init metric"] > 0
    from engine.algo.metrics.sleb import sleb_runs
    from engine.algo.policy import keep_count

    n = skeleton.num_layers
    removals = n - keep_count(0.7, n)
    eight, shortlist = (phase_tokens(PruneConfig(model=str(tiny_path), units=["layers"], layer_init="sleb",
                                                 layer_init_batches=8, sleb_finalists=k), skeleton) for k in (0, 1))
    assert removals > 0 and shortlist["init metric"] / eight["init metric"] == pytest.approx(
        sleb_runs(n, 8, 0, removals, 1) / sleb_runs(n, 8, 0, removals)) and shortlist["init metric"] < eight["init metric"]
    taylor = plan_memory(base, skeleton)
    wanda = plan_memory(pg_config(model=str(tiny_path), init="wanda-sp"), skeleton)
    # (Taylor's backward: its gradients, and the whole batch's logits where a score without gradients has the
    # head's chunks)
    assert taylor.total - wanda.total == pytest.approx(taylor.parts["gradients (Taylor init)"] + taylor.parts[
        "activations"] - wanda.parts["activations"])
    assert taylor.parts["activations"] > wanda.parts["activations"]


def test_the_memory_plan_counts_the_refits_moments_and_loading_apart(tiny_path):
    """--reconstruct keeps float64 X^T X and column sums of each output projection's inputs per layer and width
    unit type; a GGUF's dequantisation holds its buffer only while loading, so the peak is the larger of the two."""
    from engine.plan.forecast import MemoryPlan, refit_moment_bytes

    skeleton = model_skeleton(str(tiny_path))
    cfg = skeleton.adapter.config
    config = PruneConfig(model=str(tiny_path), units=["kv_groups", "channels"], reconstruct=True)
    n_heads_in = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    want = cfg.num_hidden_layers * 8 * (n_heads_in ** 2 + n_heads_in + cfg.intermediate_size ** 2 + cfg.intermediate_size)
    assert refit_moment_bytes(config, skeleton) == want
    assert plan_memory(config, skeleton).parts["refit moments (float64)"] == want
    assert refit_moment_bytes(PruneConfig(model=str(tiny_path), reconstruct=False), skeleton) == 0
    # (the refit keeps the columns it edits of each output projection to restore them; on the CPU a masked
    # forward runs a sliced copy of the kept weights)
    edits = cfg.num_hidden_layers * 4 * (n_heads_in * cfg.hidden_size + cfg.intermediate_size * cfg.hidden_size)
    parts = plan_memory(config, skeleton).parts
    assert parts["refit: the columns it edits, kept to restore"] == edits
    from engine.algo.budget import decoder_params

    assert parts["a masked forward's sliced weights"] == pytest.approx(0.7 * 4 * decoder_params(skeleton.adapter))
    hooked = plan_memory(PruneConfig(model=str(tiny_path), reconstruct=False, sample_forward="sequential"), skeleton)
    assert not {"a masked forward's sliced weights", "refit: the columns it edits, kept to restore"} & set(hooked.parts)
    plan = MemoryPlan({"process": 1.0, "weights": 2.0, "loading a GGUF": 2.0, "activations": 3.0})
    assert plan.total == 6.0  # (1 + 2 + max(2, 3))
    assert MemoryPlan({"process": 1.0, "weights": 2.0, "loading a GGUF": 5.0, "activations": 3.0}).total == 8.0


def test_the_steps_count_their_dense_forward_and_their_refits(skeleton, tiny_path):
    """--reward kl adds the step batch's dense forward to each step; --step-refit adds each sample's refit to the
    refit phase (where a run records it); under --time-budget the steps and their refits share what is left."""
    from engine.plan.forecast import refit_tokens

    base = pg_config(model=str(tiny_path), steps=10, max_windows=4, init="taylor")
    kl = pg_config(model=str(tiny_path), steps=10, max_windows=4, init="taylor", reward="kl")
    refit = pg_config(model=str(tiny_path), steps=10, max_windows=4, init="taylor", step_refit=True)
    t_base, t_kl, t_refit = (phase_tokens(c, skeleton) for c in (base, kl, refit))
    batch = base.batch_size * base.seqlen
    samples = 10 * base.num_mask_samples * batch  # (the KL scores them, and once a step's batch, its dense target)
    assert t_kl["steps"] - t_base["steps"] == pytest.approx(
        10 * batch + scoring_tokens(skeleton, samples, "kl") - scoring_tokens(skeleton, samples)
        + scoring_tokens(skeleton, 10 * batch, "kl", dense=True))
    assert scoring_tokens(skeleton, samples, "kl") > scoring_tokens(skeleton, samples) > 0
    assert t_refit["steps"] == t_base["steps"]
    assert t_refit["refit"] - t_base["refit"] == pytest.approx(10 * base.num_mask_samples * refit_tokens(base, skeleton))
    rate = 1e-4
    refit, base = (PruneConfig.of(**{**c.to_dict(), "val_every": 0}) for c in (refit, base))  # (no checks: a fixed rest)
    free = plan_time(refit, skeleton, rate, "test").phases
    fixed = plan_time(base, skeleton, rate, "test").phases["refit"]  # (the refit that is not the steps': the final mask's)
    limit = sum(free.values()) - 0.5 * (free["steps"] + free["refit"] - fixed)  # (room for about half the steps)
    budget = plan_time(PruneConfig.of(**{**refit.to_dict(), "time_budget": limit / 60}), skeleton, rate, "test").phases
    share = budget["steps"] / free["steps"]
    assert 0 < share < 1 and (budget["refit"] - fixed) / (free["refit"] - fixed) == pytest.approx(share)
    assert sum(v for k, v in budget.items()) == pytest.approx(limit)


def test_the_probe_is_measured_once_and_cached(skeleton, tmp_path):
    rate = probe_seconds_per_token(skeleton, "float32", 2, 16, cache=tmp_path)
    assert rate > 0
    assert probe_seconds_per_token(skeleton, "float32", 2, 16, cache=tmp_path) == rate  # read back, not re-measured


def test_rate_from_runs_reads_the_same_model_only():
    runs = [({"model": "m", "num_mask_samples": 2, "batch_size": 4, "seqlen": 8}, {"seconds_per_step": 6.4, "steps": 3}),
            ({"model": "m", "num_mask_samples": 2, "batch_size": 4, "seqlen": 8}, {"seconds_per_step": 3.2, "steps": 3}),
            ({"model": "other", "num_mask_samples": 2, "batch_size": 4, "seqlen": 8}, {"seconds_per_step": 99, "steps": 3}),
            ({"model": "m"}, None)]
    rate, n = rate_from_runs(runs, "m", "float32")
    assert n == 2 and rate == pytest.approx(6.4 / 64)  # the median of the two (upper one)
    assert rate_from_runs(runs, "nothing", "float32") is None


# --- the Prune form as data -------------------------------------------------------------------------
def test_form_values_round_trip_a_config(tiny_path):
    """A run's config -> the form's values -> the same config (the settings the form does not show from the base)."""
    config = PruneConfig.of(model=str(tiny_path), units=["kv_groups", "channels", "layers"], prune_ratio=0.45, steps=7, lr=0.005,
                            budget="units", val_batches=2, unit_multiple={"channels": 4}, baseline="moving-average",
                            baseline_window=3, max_windows=9, seed=3).resolved()
    values = S.form_values(config.to_dict())
    assert values["model_choice"] == "local" and values["steps"] == 7 and values["opt-pg-baseline_window"] == 3
    again = S.form_config(values, config.to_dict()).resolved()
    assert again.to_dict() == config.to_dict()
    changed = S.form_config({**values, "steps": 9}, config.to_dict()).resolved()
    assert [d[0] for d in S.config_differences(config.to_dict(), changed.to_dict())] == ["Steps"]


def test_a_fresh_form_is_the_command_lines_default_run():
    """The Prune page's first values describe the run `python -m engine prune --out X` makes (README command 1 less
    its time budget; its windows aside: the app's APP_MAX_WINDOWS) field for field: the default run
    (engine/settings/config.py's default_run: the joint preset's one-shot init), today's defaults, not an old config's
    reading of the fields the form does not show (early stop, the joint mix's batches, the bias compensation)."""
    from engine.cli import _config_from_args, parse_args
    from engine.settings.config import default_run

    app = S.form_config(S.default_values()).resolved().to_dict()
    cli = _config_from_args(parse_args(["prune", "--out", "x"])).resolved().to_dict()
    assert app.pop("max_windows") == S.APP_MAX_WINDOWS and cli.pop("max_windows") == DEFAULT_EVAL_WINDOWS
    assert app == cli == {k: v for k, v in default_run().resolved().to_dict().items() if k != "max_windows"}
    assert app["method"] == "flap" and app["units"] == PRESETS["joint"]["units"] and app["bias_compensation"]
    assert app["early_stop"] == PruneConfig.early_stop


def test_form_config_refuses_a_missing_path():
    with pytest.raises(UserError, match="give the path"):
        S.form_config({**S.default_values(), "model_choice": "local", "model_path": " "})


def test_presets_fill_the_widgets_they_name():
    paper = S.preset_values("paper")
    assert paper["lr"] == PRESETS["paper"]["lr"] and paper["opt-pg-baseline"] == PRESETS["paper"]["baseline"]
    config = S.form_config({**S.default_values(), **paper}).resolved()
    assert config.lr == PRESETS["paper"]["lr"] and config.method_options["baseline"] == PRESETS["paper"]["baseline"]


def test_joint_preset_fills_the_form_and_the_fixed_layers_box_round_trips():
    joint = S.preset_values("joint")
    assert joint["units"] == PRESETS["joint"]["units"] and joint["fixed_layers"] is True
    config = S.form_config({**S.default_values(), **joint}).resolved()
    assert config.layer_score_const == 1.0 and config.fixed_layers and config.layer_init == "layerwise-ppl"
    assert S.form_values(config)["fixed_layers"] is True
    assert S.form_values(PruneConfig())["fixed_layers"] is True  # (the default run's: the joint mix's layers fixed)
    assert S.form_values(pg_config())["fixed_layers"] is False  # (the fast preset's: none)
    sharp = PruneConfig(units=["layers", "kv_groups"], layer_score_const=0.95).to_dict()
    kept = S.form_config({**S.form_values(sharp), "fixed_layers": False}, base=sharp)
    assert kept.layer_score_const == 0.95  # unticked, a run's own c stays
    assert S.form_config({**S.form_values(config), "fixed_layers": False}, base=config.to_dict()).layer_score_const is None


def test_settings_saved_and_loaded_beside_the_runs(tmp_path):
    values = {**S.default_values(), "steps": 3, "scope": "uniform"}
    S.save_settings(tmp_path, values, {"steps": 3}, "run-x")
    assert S.load_settings(tmp_path) == (values, {"steps": 3}, "run-x")
    S.save_settings(tmp_path, {**values, "scope": "nowhere", "units": ["wings"]}, None)
    loaded, _, _ = S.load_settings(tmp_path)  # what a widget cannot show is dropped
    assert "scope" not in loaded and "units" not in loaded and loaded["steps"] == 3
    (tmp_path / S.SETTINGS_FILE).write_text("{not json")
    assert S.load_settings(tmp_path) == ({}, None, None)


def test_eta_is_the_recent_mean():
    history = [{"step": i, "seconds": s} for i, s in enumerate([10.0, 1.0, 1.0, 1.0, 1.0, 1.0], 1)]
    assert S.seconds_per_step(history) == pytest.approx(1.0)
    assert S.eta_seconds(history, 10) == pytest.approx(4.0)
    assert S.eta_seconds([], 10) is None


def test_eta_counts_the_checks_between_steps_and_what_follows_the_steps():
    """Reports stamped as they arrived: the wall rate between them (a held-out check and its refit every second
    step make it 3 s, though each step's own seconds are 1), times the steps left, plus the plan's seconds after
    the steps (the final evaluation and the export)."""
    history = [{"step": i, "seconds": 1.0, "received": 100.0 + 3.0 * i} for i in range(1, 7)]
    assert S.wall_seconds_per_step(history) == pytest.approx(3.0)
    assert S.eta_seconds(history, 10) == pytest.approx(12.0)
    assert S.eta_seconds(history, 10, after=20.0) == pytest.approx(32.0)
    assert S.wall_seconds_per_step(history[:1]) is None  # (one report: no interval yet; the steps' own seconds)
    assert S.eta_seconds(history[:1], 10) == pytest.approx(9.0)


def test_the_progress_line_names_the_work_running_and_a_phase_over_its_plan():
    check = {"phase": "validation", "seconds": 8.0, "planned": 10.0}
    assert S.running_phase_text(check) == "a held-out check running for 8 s"
    assert S.running_phase_text({"phase": "steps", "seconds": 80.0}) is None and S.running_phase_text(None) is None
    assert S.overrun_text(check) is None  # (within its plan)
    stats = {"phase": "statistics", "seconds": 320.0, "planned": 10.0}
    assert S.overrun_text(stats) == "statistics: 320 s, 32× the plan"
    assert S.overrun_text({"phase": "refit", "seconds": 36.0, "planned": 20.0}) == "refit: 36 s, 1.8× the plan"
    assert S.overrun_text({"phase": "refit", "seconds": 14.0, "planned": 2.0}) == "refit: 14 s, 7.0× the plan"
    assert S.overrun_text({"phase": "refit", "seconds": 9.0, "planned": 2.0}) is None  # (within 10 s of the plan)
    assert S.overrun_text({"phase": "load", "seconds": 50.0, "planned": None}) is None


def test_config_differences_name_every_differing_setting():
    a = PruneConfig(steps=2).to_dict()
    b = {**PruneConfig(steps=10).to_dict(), "scope": "uniform"}
    assert S.config_differences(a, b) == [("Steps", 2, 10)]  # the scope is what Compare sets apart
    assert not S.same_plan(a, b) and S.same_plan(a, {**a, "scope": "uniform"})


# --- removed layers -------------------------------------------------------------------------------
def test_removed_layers_count_their_units_as_removed():
    kept = {"kv_groups": [1.0, 0.75], "channels": [0.5, 1.0], "layers": [1.0, 0.0]}
    eff = figures.effective_kept(kept)
    assert eff["kv_groups"] == [1.0, 0.0] and eff["channels"] == [0.5, 0.0] and eff["layers"] == [1.0, 0.0]
    rows = S.layer_rows(eff, {"kv_groups": [4, 4], "channels": [8, 8]})
    kv = next(k for k in rows[1] if k.startswith("KV"))
    assert rows[1]["layer kept"] == "removed" and rows[1][kv] == "0/4"
    assert next(v for k, v in rows[0].items() if k.startswith("MLP")) == "4/8"
    assert S.rows_csv(rows).splitlines()[0].startswith("layer,layer kept")
    heat = figures.heads_heatmap([[0.9, 0.8], [0.7, 0.6]], [[1, 1], [1, 0]], removed=[1])
    grey = next(t for t in heat.data if t.name == "removed layers")
    assert grey.z[1] == [1, 1] and grey.z[0] == [None, None] and heat.data[0].z[1] == [None, None]
    bars = figures.channels_figure([0.5, 0.5], [0.5, 1.0], removed=[1])
    assert list(bars.data[0].y) == [0.5, 0.0] and any(t.name == "removed layer" for t in bars.data)


def test_the_default_evaluation_is_the_tables_protocol_and_old_configs_keep_every_window():
    """A run evaluates the first 256 windows unless told otherwise (0: all); a config saved before that default
    evaluated every window, and still reads so."""
    from engine.data.text import eval_windows

    assert PruneConfig().max_windows == DEFAULT_EVAL_WINDOWS == 256
    old = PruneConfig().to_dict()
    del old["max_windows"]
    assert PruneConfig.from_dict(old).max_windows is None

    class Chars:  # a tokenizer of one id per character
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    text = "x" * 1000  # 31 windows of 32
    assert eval_windows(Chars(), text, 32, 0).shape == eval_windows(Chars(), text, 32, None).shape == (31, 32)
    assert eval_windows(Chars(), text, 32, 5).shape == (5, 32)
    with pytest.raises(UserError, match="max windows"):
        PruneConfig(max_windows=-1).validate()


def test_under_a_time_budget_the_held_out_checks_are_those_of_the_steps_that_fit(skeleton, tiny_path):
    """A --time-budget run makes the checks of the steps it reaches (every --val-every and its last), not those
    of --steps: the plan counts those (it once planned all of --steps' checks, 36.5 s for the default run's 27)."""
    import math

    from engine.plan.forecast import validation_checks

    c = pg_config(model=str(tiny_path), steps=100, val_every=5, max_windows=4, init="taylor")
    rate = 1e-4
    free = plan_time(c, skeleton, rate, "t").phases
    per_check = free["validation"] / validation_checks(c)
    limit = sum(free.values()) - 0.8 * free["steps"]  # (room for about a fifth of the steps)
    tight = plan_time(PruneConfig.of(**{**c.to_dict(), "time_budget": limit / 60}), skeleton, rate, "t").phases
    fit = tight["steps"] / (free["steps"] / c.steps)
    assert 10 < fit < 40
    near = {validation_checks(PruneConfig.of(**{**c.to_dict(), "steps": math.ceil(fit) + d})) for d in (-1, 0, 1)}
    assert any(tight["validation"] == pytest.approx(per_check * k) for k in near) and tight["validation"] < free["validation"] / 2


def test_scoring_over_the_vocabulary_is_planned_where_a_phase_scores(skeleton, tiny_path):
    """The CE or KL over the vocabulary is float32 work a forward's matrices do not count: the plan adds it, in LM
    heads a token (engine/algo/rewards.py's score_heads), to the phases that score: Layerwise-PPL's candidates, the
    joint mix's, the checks, the evaluations, the steps."""
    from engine.algo.rewards import REWARDS

    joint = PruneConfig(model=str(tiny_path), **PRESETS["joint"])
    tokens = phase_tokens(joint, skeleton)
    assert {"init metric scoring", "joint mix scoring", "validation scoring", "evaluations scoring"} <= set(tokens)
    n, batch = skeleton.num_layers, joint.batch_size * joint.seqlen
    assert tokens["init metric scoring"] == pytest.approx(scoring_tokens(skeleton, joint.layer_init_batches * n * batch))
    assert scoring_tokens(skeleton, 1000, "kl") / scoring_tokens(skeleton, 1000) == pytest.approx(
        REWARDS["kl"].score_heads / REWARDS["ce"].score_heads)
    ce = PruneConfig.of(**{**joint.to_dict(), "reward": "ce"})
    assert phase_tokens(ce, skeleton)["validation scoring"] < tokens["validation scoring"]  # (the KL beside the CE)
    assert plan_time(ce, skeleton, 1e-4, "t").phases["steps"] < plan_time(joint, skeleton, 1e-4, "t").phases["steps"]


def test_a_run_that_prunes_no_whole_layer_lists_no_layer_settings():
    """Issue 66: a heads/channels run's Config said "Initial scores of layers: sleb", a setting that did nothing."""
    widths = {r["setting"] for r in S.settings_table(PruneConfig(units=["kv_groups", "channels"]).to_dict())}
    joint = {r["setting"] for r in S.settings_table(PruneConfig(units=["layers", "kv_groups", "channels"]).to_dict())}
    assert S.setting_label("layer_init") in joint and S.setting_label("layer_init") not in widths
    assert S.setting_label("units") in widths and S.setting_label("layer_init_batches") not in widths
    for name in ("layer_prob_map", "mix_batches", "mix_search"):  # (the layers' map, the joint mix of layers and widths)
        assert S.setting_label(name) in joint and S.setting_label(name) not in widths, name


def test_the_loss_chart_draws_a_kl_runs_check_as_a_kl_and_a_ce_runs_as_a_log_perplexity():
    """The held-out point was a log-perplexity on the "calibration loss" axis, also for a KL run, whose check is a
    mean KL; then the KL run's chart drew the check's perplexity (metrics.jsonl's val_ppl, 170.5) as its mean KL.
    A KL run's check is its val_reward (1.414), as a real KL run's metrics lines hold both."""
    import math

    from engine.ui.figures import loss_figure

    history = [{"step": s, "losses": [0.9, 0.8], "baseline": 0.85, "lr": 0.1, "val_ppl": v, "val_reward": k}
               for s, v, k in ((1, None, None), (2, 170.505, 1.4142))]
    kl = loss_figure(history, reward="kl")
    check = next(t for t in kl.data if t.name.startswith("hard mask"))
    assert check.name == "hard mask, held-out (mean KL)" and list(check.y) == [1.4142]
    assert "KL" in kl.layout.yaxis.title.text
    ce = loss_figure([{**r, "val_ppl": 120.0 if r["val_ppl"] else None} for r in history], reward="ce")
    check = next(t for t in ce.data if t.name.startswith("hard mask"))
    assert check.name == "hard mask, held-out (log ppl)" and list(check.y) == [pytest.approx(math.log(120.0))]
    named = loss_figure([{**r, "reward": "kl"} for r in history], reward="ce")  # (a line that names its reward wins)
    assert "KL" in named.layout.yaxis.title.text


def test_the_own_texts_plan_follows_its_batch_and_dtype(tiny_path, skeleton, monkeypatch):
    """The sampling's planned tokens: the float32 sampler's (32 at a time, the weights' dtype) at GENERATE_WEIGHT, a
    measured batch and dtype (the default's, 128 in bfloat16 where native) at its measured speed-up
    (GENERATE_SPEEDUP), one not measured at the float32 sampler's rate."""
    from engine.plan.forecast import GENERATE_SPEEDUP, GENERATE_WEIGHT

    monkeypatch.setenv("PG_PRUNE_NATIVE_BF16", "1")  # (auto resolves to bfloat16, as on such a CPU)
    text = {kw: phase_tokens(PruneConfig(model=str(tiny_path), calib_source="self", **dict(kw)), skeleton)
            ["calibration text"] for kw in ((("self_batch", 32), ("self_dtype", "float32")), (),
                                            (("self_batch", 7), ("self_dtype", "float32")))}
    plain, fast, other = text.values()
    assert plain == pytest.approx(256 * (256 + 8) * GENERATE_WEIGHT)
    assert fast == pytest.approx(plain / GENERATE_SPEEDUP[(128, "bfloat16")]) and other == plain
