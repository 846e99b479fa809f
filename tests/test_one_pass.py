"""Issue 51, item 1: one statistics pass (engine/algo/statistics.py). FLAP's column moments, the bias compensation's
means and the least-squares refit's moments come from one stream of forwards over the init stream, each reader
stopping at its own batch count; the results are those of the separate passes (one per reader) on the same
batches. On a tiny random LLaMA and on TinyStories-656K: the same statistics, the same masks (the joint default
preset and FLAP alone) and the same refit weights; the forwards counted, not timed.

Issue 51, must-show 4: under --time-budget, a refit whose statistics the budget cut says so (its log's last lines,
results.json's "reduced") and the plan says it before the run starts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.algo import statistics
from engine.run import initialise
from engine.model.arch import ModelAdapter
from engine.settings.config import PRESETS, PruneConfig
from engine.algo.metrics import activations
from engine.algo.metrics.activations import column_moments
from engine.run.loop import PruneRun
from engine.algo.reconstruction import InputMoments, input_moments
from engine.algo.statistics import ColumnMoments, one_pass
from engine.model.unit_types import UNIT_TYPES

from conftest import SMALL_CALIB
from test_adapters_export import build_model
from test_executors import batch
from test_pruner import assert_same_run, quiet, resume_run, small_config, stop_after

# the refit weights of the one pass and of the separate passes: the same float32 sums in the same order, so equal;
# the tolerance allows the last bits (a reordering of float64 sums that rounded differently would pass)
RTOL, ATOL = 1e-6, 1e-7
TYPES = ["kv_groups", "channels"]


def stream_of(model, n: int) -> list[torch.Tensor]:
    return [batch(model, rows=2, seqlen=11, seed=s) for s in range(n)]


def counting(monkeypatch) -> list[int]:
    """Every decoder forward the statistics run (the one pass's and the column moments' own pass's)."""
    seen: list[int] = []
    for module in (statistics, activations):
        real = module.decoder_forward
        monkeypatch.setattr(module, "decoder_forward", lambda m, b, real=real: seen.append(len(b)) or real(m, b))
    return seen


def same_moments(a, b) -> bool:
    return a.keys() == b.keys() and all(a[k][2] == b[k][2] and torch.allclose(a[k][0], b[k][0], rtol=RTOL, atol=ATOL)
                                        and torch.allclose(a[k][1], b[k][1], rtol=RTOL, atol=ATOL) for k in a)


# --- the pass itself, on a tiny random LLaMA ----------------------------------------------------------------
@pytest.mark.parametrize("max_bytes", [2 << 30, 1], ids=["one-group", "a-group-per-projection"])
def test_one_pass_gives_every_reader_its_own_passes_result(max_bytes, monkeypatch):
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    stream = stream_of(model, 5)
    flap, means, refit = ColumnMoments(2), ColumnMoments(5), InputMoments(4, TYPES, max_bytes=max_bytes)
    seen = counting(monkeypatch)
    one_pass(a, stream, [flap, means, refit])
    groups = len(refit.groups(a))
    assert len(seen) == 5 + 4 * (groups - 1)  # the longest reader's batches once; a further group reads its own again
    assert (groups > 1) == (max_bytes == 1)
    seen.clear()
    for reader, n in ((flap, 2), (means, 5)):  # column_moments' own pass: the same sums, bit for bit
        first, second, tokens = column_moments(a, stream[:n])
        assert reader.tokens == tokens == sum(b.numel() for b in stream[:n])
        assert all(torch.equal(reader.result[0][k], first[k]) and torch.equal(reader.result[1][k], second[k])
                   for k in first) and reader.result[0].keys() == first.keys()
    assert len(seen) == 2 + 5
    alone = input_moments(a, stream[:4], TYPES, max_bytes=max_bytes)
    assert same_moments(refit.result, alone)
    # against a hand computation: sum x x^T and sum x over the recorded inputs of each projection, in float64
    for (u, i), (second, total, tokens) in refit.result.items():
        x = []
        h = UNIT_TYPES[u].output_proj(a, i).register_forward_pre_hook(lambda m, args: x.append(args[0].reshape(-1, args[0].shape[-1])))
        with torch.no_grad():
            for b in stream[:4]:
                model.model(input_ids=b)
        h.remove()
        x = torch.cat(x).double()
        assert tokens == len(x)
        torch.testing.assert_close(second.double(), x.T @ x, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(total.double(), x.sum(0), rtol=1e-5, atol=1e-4)


def test_a_reader_of_other_batches_would_be_seen():
    """The comparison above fails for a pass that gave a reader other batches than its own: one batch more or
    fewer, or the stream shifted by one, changes every reader's result."""
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    stream = stream_of(model, 5)
    want = input_moments(a, stream[:3], TYPES)
    assert not same_moments(input_moments(a, stream[:4], TYPES), want)
    assert not same_moments(input_moments(a, stream[1:4], TYPES), want)
    cm = ColumnMoments(3)
    one_pass(a, stream, [cm, InputMoments(4, TYPES)])
    first, _, _ = column_moments(a, stream[:4])
    assert not all(torch.equal(cm.result[0][k], first[k]) for k in first)


def test_a_reader_that_may_stop_is_asked_only_once_the_others_batches_are_run():
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    stream = stream_of(model, 6)
    for read_anyway, stops_at in ((1, 2), (3, 3)):  # (the refit under --time-budget beside FLAP's batches)
        asked: list[int] = []
        refit = InputMoments(6, TYPES, stop=lambda done: asked.append(done) or done >= 2)
        flap = ColumnMoments(read_anyway)
        forwards = one_pass(a, stream, [flap, refit])
        assert asked == list(range(read_anyway, stops_at + 1)) and refit.batches == stops_at and forwards == stops_at
        assert refit.asked == 6 and same_moments(refit.result, input_moments(a, stream[:stops_at], TYPES))


# --- runs: the one pass against the separate passes -------------------------------------------------------------
def random_llama(vocab: int) -> LlamaForCausalLM:
    """A tiny random LLaMA (4 layers: the joint has layers to remove) over the tiny model's tokenizer's vocabulary."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


CASES = {  # the default run's settings, cheap: the joint default preset, and FLAP alone (one-shot)
    "joint": dict(PRESETS["joint"], mix_refit=True),  # (the mix scored refit: the refit's statistics choose it)
    "flap": dict(units=["kv_groups", "channels"], init="flap", method="metric"),
}


def config_for(tiny_path, eval_file, case: str, **kw) -> PruneConfig:
    base = {**PruneConfig().to_dict(), **CASES[case]}  # (today's defaults: bias compensation, the refit, one pass)
    base.update(model=str(tiny_path), steps=3, max_windows=2, batch_size=2, seqlen=48, eval_seqlen=64, init_batches=2,
                layer_init_batches=1, reconstruct_batches=4, mix_batches=1, val_batches=1,
                calib=str(SMALL_CALIB), eval_data=str(eval_file), checkpoint_every=1)
    base.update(kw)
    return PruneConfig.from_dict(base)


def run(model, tokenizer, config, out):
    logged: list[str] = []
    results = PruneRun(config, out, model=model, tokenizer=tokenizer, log=logged.append).run(progress=False)
    return results, logged


def exported(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.fixture(scope="module", params=["tinystories", "random-llama"])
def model_and_tokenizer(request, tiny):
    return tiny if request.param == "tinystories" else (random_llama(len(tiny[1])), tiny[1])


@pytest.mark.parametrize("case", list(CASES))
def test_the_one_pass_run_is_the_separate_passes_run(case, model_and_tokenizer, tiny_path, small_eval_file, tmp_path,
                                                     monkeypatch):
    model, tokenizer = model_and_tokenizer
    config = config_for(tiny_path, small_eval_file, case)
    seen = counting(monkeypatch)
    one, logged = run(model, tokenizer, config, tmp_path / "one")
    one_forwards = len(seen)
    assert one_forwards == max(config.init_batches, config.reconstruct_batches)  # FLAP's 2 are the refit's first 2
    assert any(line.startswith("statistics: one pass over 4 calibration batches") for line in logged), logged
    seen.clear()
    with monkeypatch.context() as m:  # the separate passes: the metric's own, the refit's own (and the memo's means)
        m.setattr(initialise, "statistics_pass", lambda *a, **kw: None)
        separate, _ = run(model, tokenizer, config, tmp_path / "separate")
    assert len(seen) == config.init_batches + config.reconstruct_batches
    ma, mb = load_file(str(tmp_path / "one" / "masks.safetensors")), load_file(str(tmp_path / "separate" / "masks.safetensors"))
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)  # the same mask
    wa, wb = exported(tmp_path / "one"), exported(tmp_path / "separate")
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], rtol=RTOL, atol=ATOL) for k in wa)  # refit
    for k in ("kept_per_layer", "params_pruned", "init_mix", "reconstruction"):
        assert one[k] == separate[k], k
    assert one["ppl_pruned"] == pytest.approx(separate["ppl_pruned"], rel=1e-6)
    assert one["seconds_by_phase"].get("statistics") is not None
    # a pass that read the refit other batches would be seen: 3 batches instead of 4 change the refit's weights
    fewer, _ = run(model, tokenizer, config_for(tiny_path, small_eval_file, case, reconstruct_batches=3), tmp_path / "x")
    wc = exported(tmp_path / "x")
    assert fewer["ppl_pruned"] != pytest.approx(one["ppl_pruned"], rel=1e-6)
    assert not all(wa[k].shape == wc[k].shape and torch.allclose(wa[k], wc[k], rtol=RTOL, atol=ATOL) for k in wa)


def test_the_default_runs_statistics_forwards_counted(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """The default run's batch counts (the joint preset: FLAP on 16 init batches, compensation, the refit on 128):
    144 statistics forwards in separate passes (FLAP's 16, the compensation reading FLAP's from the memo, the
    refit's 128), 128 in one pass. Counted on the tiny model; the count does not depend on the model while the refit's
    float64 sums fit in one group (2 GiB: SmolLM2-135M's are 0.65 GiB)."""
    defaults = PruneConfig()
    config = config_for(tiny_path, small_eval_file, "joint", init_batches=PRESETS["joint"]["init_batches"],
                        reconstruct_batches=defaults.reconstruct_batches, layer_init_batches=defaults.layer_init_batches,
                        batch_size=2, seqlen=16, steps=1, val_every=0, final_mask="last", mix_refit=defaults.mix_refit)
    assert (config.init_batches, config.reconstruct_batches) == (16, 128)
    seen = counting(monkeypatch)
    run(tiny[0], tiny[1], config, tmp_path / "one")
    one = len(seen)
    seen.clear()
    monkeypatch.setattr(initialise, "statistics_pass", lambda *a, **kw: None)
    run(tiny[0], tiny[1], config, tmp_path / "separate")
    assert (one, len(seen)) == (128, 16 + 128)


def test_a_run_with_the_one_pass_resumes_as_an_uninterrupted_one(tiny, tiny_path, small_eval_file, tmp_path):
    """A resumed run reads its refit's statistics again, alone, from the start of the init stream: the batches the
    fresh run's one pass read."""

    config = small_config(tiny_path, small_eval_file, reconstruct=True, refit_stream="init", reconstruct_batches=3,
                          init_batches=2, bias_compensation=True, init="flap")
    a, b = tmp_path / "A", tmp_path / "B"
    results_a = PruneRun(config, a, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    stop_after(config, b, tiny, 3)
    results_b = resume_run(b, tiny)
    assert_same_run(a, b, results_a, results_b)
    assert results_b["reconstruction"] == results_a["reconstruction"]
    assert PruneConfig.from_dict({k: v for k, v in config.to_dict().items() if k != "refit_stream"}).refit_stream == "own"


def test_the_metric_cache_leaves_the_pass_only_what_is_not_cached(tiny, tiny_path, small_eval_file, tmp_path,
                                                                  monkeypatch):
    """$PG_PRUNE_METRIC_CACHE holding FLAP's value: the pass reads only what is still wanted (here the refit's 2
    batches, not FLAP's 4), and the run is the one that computed FLAP."""
    monkeypatch.setenv("PG_PRUNE_METRIC_CACHE", str(tmp_path / "cache"))
    config = small_config(tiny_path, small_eval_file, reconstruct=True, refit_stream="init", reconstruct_batches=2,
                          init_batches=4, bias_compensation=False, init="flap", method="metric")
    seen = counting(monkeypatch)
    first = PruneRun(config, tmp_path / "a", model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    assert len(seen) == 4 and len(list((tmp_path / "cache").iterdir())) == 1
    seen.clear()
    again = PruneRun(config, tmp_path / "b", model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    assert len(seen) == 2
    assert again["kept_per_layer"] == first["kept_per_layer"] and again["ppl_pruned"] == first["ppl_pruned"]


# --- must-show 4: the time budget's trade, said ---------------------------------------------------------------
def test_a_budget_that_cuts_the_refits_statistics_says_so(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """A fake clock that says the budget is spent: the refit's statistics stop at their minimum (8 of 64), and the
    run says so in its last log lines and in results.json's "reduced"."""
    from engine.hooks.time_budget import TimeBudget

    config = config_for(tiny_path, small_eval_file, "flap", method="pg", time_budget=1.0, reconstruct_batches=64,
                        init_batches=2)
    r = PruneRun(config, tmp_path / "r", model=tiny[0], tokenizer=tiny[1], log=(logged := []).append)
    budget = next(h for h in r.res.hooks if isinstance(h, TimeBudget))
    budget.clock = lambda: r.res.started + 3600.0 + len(logged)  # (an hour gone: no time left; it moves on as the run logs)
    results = r.run(progress=False)
    assert results["reconstruction"]["batches"] == 8
    assert results["reduced"]["reconstruct_batches"] == [64, 8] and "--time-budget" in results["reduced"]["why"]
    assert json.loads((tmp_path / "r" / "results.json").read_text())["reduced"] == results["reduced"]
    last = logged[-3:]
    assert any(line.startswith("reduced under the time budget: reconstruct-batches 64 -> 8") for line in last), last
    # without the budget nothing is reduced, and nothing is said
    plain, logged = run(tiny[0], tiny[1], config_for(tiny_path, small_eval_file, "flap", method="pg",
                                                      reconstruct_batches=64, init_batches=2), tmp_path / "p")
    assert "reduced" not in plain and plain["reconstruction"]["batches"] == 64
    assert not any("reduced" in line for line in logged)


def test_the_plan_says_what_the_budget_would_cut(tiny_path):
    from engine.plan.forecast import budget_trades, model_skeleton, plan_time
    from engine.hooks.reconstruction import batches_within_share

    skeleton = model_skeleton(str(tiny_path))
    base = dict(model=str(tiny_path), reconstruct=True, reconstruct_batches=64, batch_size=8, seqlen=128)
    rate = 1e-4  # seconds per token: one batch 0.1 s, the refit's 64 batches 6.6 s
    tight = PruneConfig.of(**base, time_budget=0.2)  # 12 s: a third of what is left after loading is about 2 s
    said = budget_trades(tight, plan_time(tight, skeleton, rate, "test"))
    import re

    kept = re.search(r"--reconstruct-batches 64\) to about (\d+) batches", said[0]) if len(said) == 1 else None
    assert kept and 8 <= int(kept[1]) < 64, said  # (about 19: 2 s over 0.1 s a batch)
    roomy = PruneConfig.of(**base, time_budget=60.0)
    assert budget_trades(roomy, plan_time(roomy, skeleton, rate, "test")) == []
    unbudgeted = PruneConfig.of(**base)
    assert budget_trades(unbudgeted, plan_time(unbudgeted, skeleton, rate, "test")) == []
    # the rule the plan applies is the run's stop rule: (done + 1) batches would pass a third of the time left
    assert batches_within_share(64, 0.1, 30.0) == 64 and batches_within_share(64, 0.1, 6.0) == 20
    assert batches_within_share(64, 0.1, 0.0) == 8 and batches_within_share(4, 0.1, 0.0) == 4
    assert batches_within_share(64, 0.1, 0.0, read_anyway=16) == 16



def test_a_run_without_steps_gives_its_statistics_what_its_later_phases_leave():
    """A stepping run's statistics take at most a third of the time left (the steps get the rest); a one-shot run
    (the default preset's: no steps) may take all of it but its plan's later phases, with LATER_MARGIN."""
    from engine.hooks.reconstruction import LATER_MARGIN, STATISTICS_SHARE, batches_within_share, statistics_allowance

    plan = {"load": 50.0, "statistics": 200.0, "init metric": 40.0, "joint mix": 80.0, "evaluations": 80.0,
            "export": 2.0, "other": 0.0, "total": 452.0}
    assert statistics_allowance(True, plan) == (STATISTICS_SHARE, 0.0)
    assert statistics_allowance(False, None) == (STATISTICS_SHARE, 0.0)  # (no plan: as a stepping run)
    share, reserve = statistics_allowance(False, plan)
    assert share == 1.0 and reserve == pytest.approx(LATER_MARGIN * 202.0)
    # 550 s left when they start, 1.6 s a batch of 128: a third keeps 114, the one-shot rule all 128
    assert batches_within_share(128, 1.6, 550.0) == 114
    assert batches_within_share(128, 1.6, 550.0, 0, share, reserve) == 128
    assert batches_within_share(128, 1.6, 300.0, 0, share, reserve) == 62  # (never below a third: 100 s)
    assert batches_within_share(128, 1.6, 450.0, 0, share, reserve) == 123  # (450 - 252.5 s over 1.6 s)


def test_the_plan_of_a_one_shot_run_cuts_less_than_a_stepping_ones(tiny_path):
    from engine.plan.forecast import budget_trades, model_skeleton, plan_time

    skeleton = model_skeleton(str(tiny_path))
    base = dict(model=str(tiny_path), reconstruct=True, reconstruct_batches=64, batch_size=8, seqlen=128,
                time_budget=0.2, max_windows=8)  # (12 s; the statistics' 64 batches plan 12.3 s, the rest 1 s)
    rate = 1e-4
    import re

    def kept(config):
        said = budget_trades(config, plan_time(config, skeleton, rate, "test"))
        return int(re.search(r"to about (\d+) batches", said[0])[1]) if said else 64

    stepping, one_shot = kept(PruneConfig.of(**base)), kept(PruneConfig.of(**base, method="flap"))
    assert 8 <= stepping < one_shot < 64, (stepping, one_shot)  # (a third of 6 s left, against 6 s less the rest)
    roomier = dict(base, time_budget=0.3)
    assert kept(PruneConfig.of(**roomier)) < kept(PruneConfig.of(**roomier, method="flap")) == 64


# --- torchrun ---------------------------------------------------------------------------------------------------
@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
@pytest.mark.parametrize("extra", [["--no-reconstruct"], ["--reconstruct-batches", "3"]], ids=["dealt-out", "every-rank"])
def test_two_ranks_pass_as_one_process(extra, tmp_path):
    """Without the refit the ranks deal the stream's batches out (FLAP's and the compensation's column moments,
    gathered in batch order); with it every rank runs every batch (the refit's float64 sums are one process's):
    either way the one process's run, bit for bit."""
    from conftest import WIKI_RAW
    from test_distributed import one_and_two_ranks

    eval_file = tmp_path / "wiki.small.txt"
    eval_file.write_text(WIKI_RAW.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    one, two, _ = one_and_two_ranks(eval_file, tmp_path, 2, ["--init", "flap", "--units", "heads,channels",
                                                             "--init-batches", "3", "--num-mask-samples", "2", *extra])
    ca, cb = (torch.load(d / "checkpoint.pt", weights_only=False) for d in (one, two))
    assert all(torch.equal(ca["init_metric"][u], cb["init_metric"][u]) for u in ca["init_metric"])


def test_the_apps_plan_warns_before_start(tmp_path, monkeypatch):
    """The app's plan panel says the trade before Start (engine.plan.forecast.budget_trades), and nothing without a budget."""
    from test_app import app, fill_prune_form

    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    at = fill_prune_form(app(), steps=3)
    at.run()
    assert not any("refit's statistics" in w.value for w in at.warning)
    at.number_input(key="time_budget").set_value(0.05).run()  # 3 s: nothing left for the statistics
    said = [w.value for w in at.warning if "refit's statistics" in w.value]
    wanted = f"--reconstruct-batches {PruneConfig().reconstruct_batches}) to about 8 batches"
    assert len(said) == 1 and wanted in said[0], [w.value for w in at.warning]
