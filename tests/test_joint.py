"""The joint method (issue 27): layers, KV groups and channels on one parameter budget. Its starting mix of
whole layers and width is the candidate whose one-shot mask loses least; these tests check the candidates,
the choice and the budget of what it starts from, with a known loss in place of the model's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.settings.config import PruneConfig
from engine.algo.joint import candidate_scores, layer_counts
from engine.algo.context import KEEP
from engine.run.mix import choose_mix, hard_mask_loss

from test_budget import param_budget


def test_layer_counts_span_none_to_the_most_the_budget_allows():
    assert layer_counts([10] * 10, 35.0) == [0, 1, 2, 3]  # at most 3 whole layers fit in a removal of 35
    assert layer_counts([10] * 4, 100.0) == [0, 1, 2, 3]  # never every layer
    assert layer_counts([10] * 10, 5.0) == [0]  # less than a layer: width only


def fake_run(units=("layers", "kv_groups", "channels"), keep=0.6):
    budget, adapter, layout = param_budget("llama", units, "global")
    config = PruneConfig(units=list(units), prune_ratio=1 - keep, budget="params")
    logs = []
    run = SimpleNamespace(config=config, budget=budget, layout=layout, log=logs.append,
                          masks=SimpleNamespace(hard_masks=lambda scores, k=keep: budget.hard_masks(scores, k)))
    g = torch.Generator().manual_seed(0)
    z = {u: torch.randn(layout.total(u), generator=g) for u in units}
    return run, z, adapter, logs


@pytest.mark.parametrize("best_layers", [0, 1])
def test_the_mix_that_loses_least_is_chosen(best_layers):
    """A loss that is lowest with `best_layers` whole layers removed: the run starts from that mix, on budget."""
    run, z, adapter, logs = fake_run()
    keep = 1 - run.config.prune_ratio

    def loss(masks, batch):
        return abs(int((masks["layers"] <= 0.5).sum()) - best_layers) + float(batch)

    scores, lines = choose_mix(run, z, [torch.tensor(0.0), torch.tensor(1.0)], keep, loss=loss)
    counts = [line["layers_removed"] for line in lines]
    assert counts == sorted(set(counts)) and len(counts) >= 2  # every candidate once, from none up
    assert min(lines, key=lambda line: line["loss"])["layers_removed"] == best_layers
    masks = run.budget.hard_masks(scores, keep)
    assert int((masks["layers"] <= 0.5).sum()) == best_layers
    assert run.budget.expected_kept(scores) <= run.budget.kept_target(keep) * (1 + 1e-6)
    assert len(logs) == len(lines) + 1 and all("joint mix" in m for m in logs)  # (one per candidate, and how many)


def test_refining_compares_the_best_mixes_again_on_more_batches(monkeypatch):
    """On the mix batches 1 layer out loses least, 0 next and 2 third; on the further batches 0 layers out does
    better than 1, and 2 best of all. With refinement the mean over every batch decides among the finalists: 2
    of the 3 when there are 3 finalists; 0 when only 2 are (then 2 is never run on the further batches)."""
    import engine.run.mix as mix

    run, z, adapter, logs = fake_run(keep=0.3)
    keep = 0.3
    assert layer_counts(run.budget.layer_params, run.budget.decoder - run.budget.kept_target(keep)) == [0, 1, 2]
    first, more = [torch.tensor(0.0)] * 2, [torch.tensor(1.0)] * 6
    calls = []

    def loss(masks, batch):
        k = int((masks["layers"] <= 0.5).sum())
        calls.append((k, float(batch)))
        return {0: 1.1, 1: 1.0, 2: 1.2}[k] if float(batch) == 0.0 else {0: 0.5, 1: 1.0, 2: -5.0}[k]

    def chosen(scores):
        return int((run.budget.hard_masks(scores, keep)["layers"] <= 0.5).sum())

    scores, plain = choose_mix(run, z, first, keep, loss=loss)
    assert chosen(scores) == 1 and all("loss_refined" not in line for line in plain)
    calls.clear()
    scores, lines = choose_mix(run, z, first, keep, loss=loss, more=more)
    assert chosen(scores) == 2
    refined = {line["layers_removed"]: line["loss_refined"] for line in lines if "loss_refined" in line}
    assert refined == pytest.approx({0: (1.1 * 2 + 0.5 * 6) / 8, 1: 1.0, 2: (1.2 * 2 - 5.0 * 6) / 8})
    assert run.budget.expected_kept(scores) <= run.budget.kept_target(keep) * (1 + 1e-6)
    monkeypatch.setattr(mix, "MIX_FINALISTS", 2)  # (the refinement reads it where choose_mix is)
    calls.clear()
    scores, lines = choose_mix(run, z, first, keep, loss=loss, more=more)
    assert chosen(scores) == 0 and sorted({k for k, b in calls if b == 1.0}) == [0, 1]


def test_a_joint_run_refines_its_mix_on_the_next_init_batches(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """--mix-refine-batches N: the finalists are compared on the N init batches after the mix's (the batches
    the metric read: with --init-data all, what a one-shot run of the seed reads), and the plan counts them."""
    import engine.run.initialise as initialise
    from engine.plan.forecast import model_skeleton, phase_tokens
    from test_methods import run_tiny

    seen = []
    real = initialise.choose_mix

    def spy(run, z, batches, keep, **kw):
        seen.append((len(batches), len(kw["more"])))
        return real(run, z, batches, keep, **kw)

    monkeypatch.setattr(initialise, "choose_mix", spy)
    run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", method="flap", units=["layers", "kv_groups", "channels"],
             layer_init="sleb", prune_ratio=0.5, budget="params", mix_batches=2, mix_refine_batches=3, init_batches=4)
    assert seen == [(2, 3)]
    skeleton = model_skeleton(str(tiny_path))
    base = dict(model=str(tiny_path), units=["layers", "kv_groups", "channels"], prune_ratio=0.5, mix_batches=2)
    plain, refined = (phase_tokens(PruneConfig(**base, mix_refine_batches=n), skeleton)["joint mix"] for n in (0, 3))
    assert refined > plain


def test_a_candidate_removes_the_least_important_layers_and_cuts_width_to_the_rest():
    run, z, adapter, _ = fake_run()
    keep = 1 - run.config.prune_ratio
    z["layers"] = torch.tensor([3.0, -2.0, 1.0, 0.5][: adapter.num_layers])
    scores = candidate_scores(run.budget, z, run.layout, 1, keep, run.config)
    masks = run.budget.hard_masks(scores, keep)
    assert masks["layers"].tolist() == [1.0 if i != 1 else 0.0 for i in range(adapter.num_layers)]  # the lowest
    kept = run.budget.kept_params(masks)
    heaviest = max(float(run.budget.weights[u].max()) for u in ("kv_groups", "channels"))
    assert run.budget.kept_target(keep) - heaviest < kept <= run.budget.kept_target(keep) + 1e-6


def test_the_metric_cache_returns_the_same_computation(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """$PG_PRUNE_METRIC_CACHE: a second run with the same metric, model, budget, seed and batches reads the
    first one's result (and ends on the same mask); another seed computes its own."""
    from test_methods import run_tiny

    monkeypatch.setenv("PG_PRUNE_METRIC_CACHE", str(tmp_path / "cache"))
    kw = dict(method="metric", units=["layers"], layer_init="sleb", prune_ratio=0.5)
    first = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "a", **kw)
    files = sorted((tmp_path / "cache").iterdir())
    assert len(files) == 1 and files[0].name.startswith("sleb-")
    second = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "b", **kw)
    assert sorted((tmp_path / "cache").iterdir()) == files and second["kept_per_layer"] == first["kept_per_layer"]
    run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "c", seed=1, **kw)
    assert len(list((tmp_path / "cache").iterdir())) == 2


def width_share(budget, masks, u):
    """The share of width type u's parameters kept in the layers the mask keeps."""
    in_kept = masks["layers"][budget.width_layer[u]] > 0.5
    w = budget.weights[u][in_kept]
    return float((w * (masks[u][in_kept] > 0.5)).sum() / w.sum())


def test_comparable_width_metrics_split_the_width_by_one_ranking():
    """With FLAP-like metrics (comparable across types) the candidate's width goes where the one ranking puts it:
    heads scored far above every channel keep all of theirs and channels lose the whole width budget; without
    comparability both types keep the same share."""
    run, z, adapter, _ = fake_run(keep=0.8)
    keep = 0.8
    z["kv_groups"], z["channels"] = z["kv_groups"].abs() + 10.0, z["channels"] - 10.0
    b = run.budget
    equal = b.hard_masks(candidate_scores(b, z, run.layout, 0, keep, run.config), keep)
    ranked = b.hard_masks(candidate_scores(b, z, run.layout, 0, keep, run.config, frozenset({"kv_groups", "channels"})), keep)
    assert width_share(b, ranked, "kv_groups") == 1.0 and width_share(b, ranked, "channels") < width_share(b, equal, "channels")
    assert abs(width_share(b, equal, "kv_groups") - width_share(b, equal, "channels")) < 0.35  # (KV groups round coarsely)
    assert b.expected_kept(candidate_scores(b, z, run.layout, 0, keep, run.config, frozenset({"kv_groups", "channels"}))) \
        <= b.kept_target(keep) * (1 + 1e-6)


def test_the_joint_mix_is_chosen_on_compensated_losses(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """--bias-compensation: the means are measured before the mix is chosen, so every candidate's loss is the
    compensated model's (the same masking the run optimises and exports)."""
    import engine.run.initialise as initialise
    from test_methods import run_tiny

    seen = []
    real = initialise.choose_mix

    losses = []

    def spy(run, z, batches, keep, **kw):
        seen.append(run.ctx.comp_means)
        scores, lines = real(run, z, batches, keep, **kw)
        masks = run.masks.hard_masks(scores, keep)  # (hard_mask_loss: the run's means, other means, or none)
        losses.append([hard_mask_loss(run, masks, batches[0], comp_means) for comp_means in (KEEP, run.ctx.comp_means, None)])
        return scores, lines

    monkeypatch.setattr(initialise, "choose_mix", spy)
    run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", method="flap", units=["layers", "kv_groups", "channels"],
             layer_init="sleb", prune_ratio=0.5, budget="params")
    assert len(seen) == 1 and seen[0] is not None and set(seen[0]) == {"kv_groups", "channels"}
    own, given, uncompensated = losses[0]
    assert own == given and own != uncompensated


def test_fixed_layers_keep_their_probabilities_and_the_widths_take_the_budget():
    """--layer-score-const 1: layers at probability 0/1 are not projected; the kept layers' widths are projected
    (exactly: the weighted capped simplex over them) onto what the kept layers' fixed parameters leave, and the
    widths of a removed layer are left alone."""
    from engine.algo.policy import project_weighted_capped_simplex

    run, z, adapter, _ = fake_run(keep=0.6)
    b, keep = run.budget, 0.6
    b.fixed_layers = True
    n = len(b.layer_params)
    layers = torch.ones(n)
    layers[1] = 0.0
    scores = {"layers": layers, **{u: torch.full_like(z[u], 0.9) + 0.05 * torch.rand_like(z[u]) for u in b.widths}}
    out = b.project(scores, keep)
    assert torch.equal(out["layers"], layers)
    in_kept = {u: layers[b.width_layer[u]] > 0.5 for u in b.widths}
    for u in b.widths:  # a removed layer's widths are moot
        assert torch.equal(out[u][~in_kept[u]], scores[u][~in_kept[u]])
    assert b.expected_kept(out) == pytest.approx(b.kept_target(keep), rel=1e-6)
    zk = torch.cat([scores[u].double()[in_kept[u]] for u in b.widths])
    wk = torch.cat([b.weights[u][in_kept[u]] for u in b.widths])
    want = project_weighted_capped_simplex(zk, wk, b.kept_target(keep) - float(b.fixed[layers > 0.5].sum()))
    got = torch.cat([out[u].double()[in_kept[u]] for u in b.widths])
    assert torch.allclose(got, want.to(got.dtype), atol=1e-6)


def test_layer_score_const_validates():
    from engine.errors import UserError

    assert PruneConfig(layer_score_const=1.0).resolved().score_const_for("layers") == 1.0
    assert PruneConfig(layer_score_const=None).resolved().score_const_for("layers") == PruneConfig.score_const
    assert PruneConfig(layer_score_const=1.0, layer_prob_map="score-const").fixed_layers
    assert not PruneConfig(layer_score_const=1.0, layer_prob_map="sigmoid-norm").fixed_layers
    for bad in (0.5, 1.5):
        with pytest.raises(UserError, match="layer score-const"):
            PruneConfig(layer_score_const=bad).validate()


def test_a_joint_run_with_fixed_layers_learns_the_widths_only(tiny, tiny_path, small_eval_file, tmp_path):
    """PG joint with --layer-score-const 1: the layers the mix chose stay chosen at every step (their scores
    stay 0/1), the widths move, and the expected kept parameters stay at the budget."""
    from engine.run.folder import CHECKPOINT_FILE
    from test_methods import run_tiny

    out = tmp_path / "r"
    results = run_tiny(tiny, tiny_path, small_eval_file, out, units=["layers", "kv_groups", "channels"], layer_init="sleb",
                       prune_ratio=0.5, budget="params", layer_score_const=1.0, steps=3, num_mask_samples=3,
                       lr=0.5, final_mask="last", val_every=0)
    state = torch.load(out / CHECKPOINT_FILE, weights_only=False)
    init, now = state["init_scores"], state["scores"]
    assert set(init["layers"].tolist()) <= {0.0, 1.0} and torch.equal(now["layers"], init["layers"])
    assert any(not torch.equal(now[u], init[u]) for u in ("kv_groups", "channels"))
    assert results["steps"] == 3 and results["kept_per_layer"]["layers"] == [int(p) for p in init["layers"].tolist()]


@pytest.mark.parametrize("units", [["kv_groups", "channels"], ["layers", "kv_groups", "channels"]], ids=["widths", "joint"])
def test_a_pg_run_starts_from_the_one_shot_mask_of_its_seed(units, tiny, tiny_path, small_eval_file, tmp_path):
    """--init-data all (the default): with validation on, the steps never see the held-out documents, but the init
    metric and the joint mix read what a one-shot run of the seed reads, so PG's init mask (exported here: no later
    mask can beat it by a margin of 100 %) is the one-shot run's mask; --init-data training reads other batches."""
    from engine.export.artifacts import load_mask_artifact
    from engine.run.folder import CHECKPOINT_FILE
    from test_methods import run_tiny

    common = dict(units=units, init="flap", layer_init="sleb", prune_ratio=0.5, budget="params", init_batches=3,
                  layer_init_batches=2, mix_batches=2, bias_compensation=True)
    one_shot = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "one", method="flap", init_data="all", **common)
    runs = {d: run_tiny(tiny, tiny_path, small_eval_file, tmp_path / d, method="pg", steps=2, num_mask_samples=2,
                        val_every=1, val_batches=1, best_val_margin=1.0, init_data=d, **common) for d in ("all", "training")}
    _, want, _ = load_mask_artifact(tmp_path / "one")
    _, got, _ = load_mask_artifact(tmp_path / "all")
    assert runs["all"]["mask_step"] == 0 and want.keys() == got.keys()
    assert all(torch.equal(want[u], got[u]) for u in want)
    assert runs["all"]["ppl_init"] == one_shot["ppl_pruned"] != runs["training"]["ppl_init"]
    z = {d: torch.load(tmp_path / d / CHECKPOINT_FILE, weights_only=False)["init_metric"] for d in ("all", "training")}
    assert not torch.equal(z["all"]["channels"], z["training"]["channels"])  # (the held-out documents' batches differ)


def test_init_data_defaults_to_all_and_old_configs_read_training():
    """A run reads its init from every calibration document unless told otherwise; a config saved before that
    default read the training documents (the held-out ones removed), and resumes so."""
    assert PruneConfig().init_data == "all"
    old = PruneConfig().to_dict()
    del old["init_data"]
    assert PruneConfig.from_dict(old).init_data == "training" and PruneConfig.of().init_data == "training"
    with pytest.raises(Exception, match="init"):
        PruneConfig(init_data="everything").validate()


def test_sleb_continues_a_cached_order_and_a_run_to_a_lower_ratio_takes_its_prefix(tiny, tiny_path, small_eval_file,
                                                                                   tmp_path, monkeypatch):
    """SLEB's greedy order to a lower keep ratio starts with the order to a higher one: from the metric cache a run
    makes only the removals beyond those cached (none when the cache went further), and ends where a run without
    the cache ends."""
    from engine.model.arch import ModelAdapter
    from engine.algo.metrics import METRICS, MetricContext
    from engine.algo.metrics.registry import removal_order
    from engine.model.unit_types import unit_sizes
    from test_methods import _Layout, build_model

    a = ModelAdapter.for_model(build_model("llama"))  # 3 layers
    batches = [torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(k)) for k in range(2)]

    def sleb(keep, prefix=()):
        lines = []
        ctx = MetricContext(a, _Layout(unit_sizes(a)), batches, keep_ratio=keep, log=lines.append, prefix=list(prefix))
        return METRICS["sleb"].fn(ctx, ["layers"]), lines

    full, lines = sleb(0.34)  # 2 of 3 layers out: 3 + 2 model runs a batch
    assert lines[-1] == "sleb: 10/10 model runs"
    order = removal_order(full)
    assert len(order) == 2 and removal_order(sleb(0.67)[0]) == order[:1]
    rest, lines = sleb(0.34, order[:1])  # the second removal only: 2 model runs a batch
    assert lines[-1] == "sleb: 4/4 model runs" and [float(t) for t in rest["layers"]] == [float(t) for t in full["layers"]]
    fewer, lines = sleb(0.67, order)  # the cache went further: no model run
    assert lines == [] and removal_order(fewer) == order[:1]


def test_the_metric_cache_keeps_sleb_s_order_across_ratios(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """One cache entry per batches for SLEB, whatever the ratio, and each run ends on the mask a run without the
    cache ends on (on this 2-layer model both ratios remove one layer: the extension of an order is
    test_the_metric_cache_extends_sleb_s_order's, on 3 layers)."""
    from test_methods import run_tiny

    kw = dict(method="metric", units=["layers", "kv_groups", "channels"], layer_init="sleb", init="wanda-sp",
              budget="params")
    plain = {r: run_tiny(tiny, tiny_path, small_eval_file, tmp_path / f"plain{r}", prune_ratio=r, **kw)
             for r in (0.3, 0.6)}
    monkeypatch.setenv("PG_PRUNE_METRIC_CACHE", str(tmp_path / "cache"))
    for r in (0.3, 0.6, 0.3):
        got = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / f"c{r}", prune_ratio=r, **kw)
        assert got["kept_per_layer"] == plain[r]["kept_per_layer"]
        assert len([f for f in (tmp_path / "cache").iterdir() if f.name.startswith("sleb-")]) == 1


def test_an_order_made_with_sleb_finalists_is_cached_apart(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """SLEB with finalists can remove other layers than SLEB: its order gets its own metric-cache entry, which a
    later run with the same finalists reads (and SLEB's own entry stays SLEB's)."""
    from test_methods import run_tiny

    kw = dict(method="metric", units=["layers", "kv_groups", "channels"], layer_init="sleb", init="wanda-sp",
              budget="params", prune_ratio=0.3, layer_init_batches=4)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PG_PRUNE_METRIC_CACHE", str(cache))

    def entries():
        return sorted((f.name, f.stat().st_mtime_ns) for f in cache.iterdir() if f.name.startswith("sleb-"))

    run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "exact", **kw)
    assert len(entries()) == 1
    short = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "short", sleb_finalists=1, **kw)
    two = entries()
    assert len(two) == 2
    again = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "again", sleb_finalists=1, **kw)
    assert entries() == two  # read, not written again
    assert again["kept_per_layer"] == short["kept_per_layer"]


def test_the_metric_cache_extends_sleb_s_order(tmp_path, monkeypatch):
    """cached_metric on a 3-layer model: a run to 1 layer out stores an order of 1; a run to 2 out takes it and
    makes the second removal only, then stores the order of 2; a run to 1 out then makes no model run."""
    from engine.model.arch import ModelAdapter
    from engine.model.distributed import World
    from engine.run.initialise import cached_metric
    from engine.algo.metrics import MetricContext
    from engine.model.unit_types import unit_sizes
    from test_methods import _Layout, build_model

    monkeypatch.setenv("PG_PRUNE_METRIC_CACHE", str(tmp_path))
    a = ModelAdapter.for_model(build_model("llama"))
    batches = [torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    logged: list[str] = []
    run = SimpleNamespace(world=World(), source=SimpleNamespace(path="m", gguf_file=None),
                          config=SimpleNamespace(dtype="float32", pass_dtype="float32", device="cpu"), model=None,
                          log=logged.append)

    def sleb(keep):
        logged.clear()
        ctx = MetricContext(a, _Layout(unit_sizes(a)), batches, keep_ratio=keep, log=logged.append)
        return cached_metric(run, "sleb", ["layers"], ctx)["layers"], [line for line in logged if "model runs" in line]

    def stored():
        (f,) = tmp_path.iterdir()
        return torch.load(f)["order"]

    one, runs = sleb(0.67)
    assert runs[-1] == "sleb: 6/6 model runs" and len(stored()) == 1
    two, runs = sleb(0.34)
    assert runs[-1] == "sleb: 4/4 model runs" and stored()[:1] == [int(torch.cat(one).argmin())] and len(stored()) == 2
    again, runs = sleb(0.67)
    assert runs == [] and [float(t) for t in again] == [float(t) for t in one]


def test_sleb_stores_its_order_after_each_removal(tmp_path, monkeypatch):
    """A run stopped during SLEB keeps the removals it made: the cache holds the order after each one, and the next
    run continues from there."""
    import engine.algo.metrics.layerwise_ppl as layerwise_ppl
    from engine.model.arch import ModelAdapter
    from engine.model.distributed import World
    from engine.run.initialise import cached_metric
    from engine.algo.metrics import MetricContext
    from engine.model.unit_types import unit_sizes
    from test_methods import _Layout, build_model

    monkeypatch.setenv("PG_PRUNE_METRIC_CACHE", str(tmp_path))
    a = ModelAdapter.for_model(build_model("llama"))
    batches = [torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    run = SimpleNamespace(world=World(), source=SimpleNamespace(path="m", gguf_file=None),
                          config=SimpleNamespace(dtype="float32", pass_dtype="float32", device="cpu"), model=None,
                          log=lambda line: None)
    ctx = lambda: MetricContext(a, _Layout(unit_sizes(a)), batches, keep_ratio=0.34)  # noqa: E731 (2 removals)
    reference = cached_metric(run, "sleb", ["layers"], ctx())
    (entry,) = tmp_path.iterdir()
    order = torch.load(entry)["order"]
    entry.unlink()
    real, rounds = layerwise_ppl.shared_losses_without_each, []

    def stopped_in_the_second_round(*args, **kwargs):
        rounds.append(1)
        if len(rounds) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr("engine.algo.metrics.sleb.shared_losses_without_each", stopped_in_the_second_round)
    with pytest.raises(KeyboardInterrupt):
        cached_metric(run, "sleb", ["layers"], ctx())
    assert torch.load(entry)["order"] == order[:1]
    monkeypatch.setattr("engine.algo.metrics.sleb.shared_losses_without_each", real)
    assert [float(t) for t in cached_metric(run, "sleb", ["layers"], ctx())["layers"]] == \
        [float(t) for t in reference["layers"]]
    assert torch.load(entry)["order"] == order


def test_without_a_cache_sleb_keeps_its_order_in_the_run_folder_until_the_first_checkpoint(
        tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """No $PG_PRUNE_METRIC_CACHE: SLEB's removals so far go to the run's init_progress/ (so that --resume after a
    stop during SLEB continues them), which the run removes once its first checkpoint holds the init."""
    import engine.run.initialise as initialise
    from engine.model.arch import ModelAdapter
    from engine.model.distributed import World
    from engine.algo.metrics import MetricContext
    from engine.run.files import INIT_PROGRESS_DIR
    from engine.model.unit_types import unit_sizes
    from test_methods import _Layout, build_model, run_tiny

    monkeypatch.delenv("PG_PRUNE_METRIC_CACHE", raising=False)
    a = ModelAdapter.for_model(build_model("llama"))
    batches = [torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    logged: list[str] = []
    run = SimpleNamespace(world=World(), source=SimpleNamespace(path="m", gguf_file=None), out=tmp_path / "run",
                          config=SimpleNamespace(dtype="float32", pass_dtype="float32", device="cpu"), model=None,
                          log=logged.append)
    ctx = lambda keep: MetricContext(a, _Layout(unit_sizes(a)), batches, keep_ratio=keep)  # noqa: E731
    first = initialise.cached_metric(run, "sleb", ["layers"], ctx(0.67))
    (entry,) = (tmp_path / "run" / INIT_PROGRESS_DIR).iterdir()
    assert len(torch.load(entry)["order"]) == 1
    initialise.cached_metric(run, "sleb", ["layers"], ctx(0.34))  # (as --resume would: one removal taken)
    assert any("1 removals taken from the run's stopped start" in line for line in logged)
    assert len(torch.load(entry)["order"]) == 2 and first  # (and a real run clears the folder:)
    out, seen, real = tmp_path / "r", [], initialise.cached_metric

    def spy(*args, **kwargs):
        value = real(*args, **kwargs)
        seen.append(sorted(p.name.split("-")[0] for p in (out / INIT_PROGRESS_DIR).iterdir()))
        return value

    monkeypatch.setattr(initialise, "cached_metric", spy)
    run_tiny(tiny, tiny_path, small_eval_file, out, method="metric", units=["layers"], layer_init="sleb",
             prune_ratio=0.5)
    assert seen == [["sleb"]]  # (during the init)
    assert (out / "results.json").exists() and not (out / INIT_PROGRESS_DIR).exists()
