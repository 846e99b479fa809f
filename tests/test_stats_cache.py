"""Issue 65, the second run: the dense model's statistics (FLAP's column moments, the refit's input moments) and the
init metric come from their caches on a run that reads the same batches of the same model ($PG_PRUNE_STATS_CACHE,
$PG_PRUNE_METRIC_CACHE; by default under $PG_PRUNE_CACHE). The cached run is the computed one, weight for weight;
another seed, another model file or a model given in memory computes its own; an unreadable entry is computed
again and said; a reader stopped early leaves its sums, which the next run continues; the folder keeps its newest
entries within its bytes."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from engine.algo import statistics
from engine.model.arch import ModelAdapter
from engine.run.loop import PruneRun
from engine.algo.reconstruction import InputMoments
from engine.run.plan import PLAN_KEY
from engine.algo.statistics import ColumnMoments, StatisticsCache, one_pass

from conftest import engine_in_process
from test_adapters_export import build_model
from test_one_pass import config_for, counting, same_moments, stream_of

TYPES = ["kv_groups", "channels"]


def from_files(tiny, config, out):
    """A run of the tiny model as read from its files (what is cached per model applies to it)."""
    logged: list[str] = []
    results = PruneRun(config, out, model=tiny[0], tokenizer=tiny[1], log=logged.append, from_files=True).run(
        progress=False)
    return results, logged


def weights(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


def planned_caches(monkeypatch) -> list:
    """The `cached` phases each fresh run's time plan is made with (engine/plan/forecast.py's plan_time), in order."""
    from engine.plan import forecast as plan

    seen, real = [], plan.plan_time

    def spy(*args, **kwargs):
        if kwargs.get("done_steps") is None:
            seen.append(kwargs.get("cached") or {})
        return real(*args, **kwargs)

    monkeypatch.setattr(plan, "plan_time", spy)
    return seen


@pytest.fixture
def caches(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.delenv("PG_PRUNE_STATS_CACHE")
    monkeypatch.delenv("PG_PRUNE_METRIC_CACHE")
    monkeypatch.setenv("PG_PRUNE_CACHE", str(folder))
    return folder


def test_a_second_run_reads_the_first_runs_statistics_and_ends_on_the_same_model(
        caches, tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    config = config_for(tiny_path, small_eval_file, "joint")
    seen = counting(monkeypatch)
    planned = planned_caches(monkeypatch)
    first, logged = from_files(tiny, config, tmp_path / "first")
    assert len(seen) == config.reconstruct_batches and any("one pass over" in ln for ln in logged)
    entries = sorted(p.name for p in (caches / "statistics").iterdir())
    assert [e.split("-")[0] for e in entries] == ["column", "input"]  # FLAP's moments and the refit's
    assert len(list((caches / "metrics").iterdir())) >= 1  # the init metric, by default under $PG_PRUNE_CACHE
    seen.clear()
    second, logged = from_files(tiny, config, tmp_path / "second")
    assert seen == [] and not any("one pass over" in ln for ln in logged)  # no statistics forward at all
    assert sum("from the cache" in ln for ln in logged) == 2
    assert any("taken from the metric cache" in ln for ln in logged)
    wa, wb = weights(tmp_path / "first"), weights(tmp_path / "second")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for k in ("kept_per_layer", "init_mix", "ppl_pruned", "reconstruction"):
        assert first[k] == second[k], k
    assert sorted(p.name for p in (caches / "statistics").iterdir()) == entries
    # the second run's plan knew it (the cached phases planned at 0 s), the first's did not
    assert planned == [{}, {"statistics": 0.0, "init metric": 0.0}]
    assert second[PLAN_KEY]["statistics"] == second[PLAN_KEY]["init metric"] == 0
    # another seed draws other batches: its own entries
    from_files(tiny, config_for(tiny_path, small_eval_file, "joint", seed=1), tmp_path / "seed1")
    assert len(list((caches / "statistics").iterdir())) == 4


def test_a_model_given_in_memory_or_another_file_computes_its_own(caches, tiny, tiny_path, small_eval_file, tmp_path,
                                                                   monkeypatch):
    config = config_for(tiny_path, small_eval_file, "flap")
    PruneRun(config, tmp_path / "mem", model=tiny[0], tokenizer=tiny[1], log=lambda s: None).run(progress=False)
    assert not (caches / "statistics").exists() and not (caches / "metrics").exists()
    from_files(tiny, config, tmp_path / "a")
    assert len(list((caches / "statistics").iterdir())) == 2
    # the same model's files with one weight written over: another model (the key is the files' content)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_path, other)
    w = load_file(str(other / "model.safetensors"))
    name = next(k for k in w if k.endswith("o_proj.weight"))
    w[name] = w[name] * 0.5
    from safetensors.torch import save_file
    save_file(w, str(other / "model.safetensors"), metadata={"format": "pt"})
    logged: list[str] = []
    PruneRun(config_for(other, small_eval_file, "flap"), tmp_path / "b", log=logged.append).run(progress=False)
    assert any("one pass over" in ln for ln in logged)
    assert len(list((caches / "statistics").iterdir())) == 4


def test_an_unreadable_entry_is_computed_again_and_said(caches, tiny, tiny_path, small_eval_file, tmp_path):
    config = config_for(tiny_path, small_eval_file, "flap")
    first, _ = from_files(tiny, config, tmp_path / "a")
    for p in (caches / "statistics").iterdir():
        p.write_bytes(b"not a torch file")
    second, logged = from_files(tiny, config, tmp_path / "b")
    said = [ln for ln in logged if "cannot be read" in ln]
    assert len(said) == 2 and all("computed again" in ln for ln in said)
    assert second["ppl_pruned"] == first["ppl_pruned"]
    third, logged = from_files(tiny, config, tmp_path / "c")  # written over: read again
    assert sum("from the cache" in ln for ln in logged) == 2 and third["ppl_pruned"] == first["ppl_pruned"]


def test_the_cache_gives_the_readers_their_computed_results_and_a_stopped_ones_sums_to_continue(tmp_path):
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    stream = stream_of(model, 5)
    cache = StatisticsCache(tmp_path, "model-key")
    flap, refit = ColumnMoments(2), InputMoments(4, TYPES)
    one_pass(a, stream, [flap, refit])
    for r in (flap, refit):
        cache.write(r, stream)
    again_flap, again_refit = ColumnMoments(2), InputMoments(4, TYPES)
    assert cache.read(again_flap, stream) and cache.read(again_refit, stream)
    assert same_moments(again_refit.result, refit.result) and again_refit.tokens == refit.tokens
    assert all(torch.equal(again_flap.result[0][k], flap.result[0][k]) for k in flap.result[0])
    # other batches, another batch count or another model: nothing cached for them
    assert not cache.read(InputMoments(4, TYPES), stream[1:])
    assert not cache.read(InputMoments(3, TYPES), stream)
    assert not StatisticsCache(tmp_path, "another-model").read(InputMoments(4, TYPES), stream)
    # a reader the time budget stopped holds a part of its batches: not its whole entry, but its sums, which the
    # next reader of the same stream continues: stopped once more, then to the end, it ends on the
    # uninterrupted pass's sums, value for value. Its stop is asked with the batches the pass read for it: a
    # continued reader whose time is up at once still reads one batch past its cached ones, never fewer
    whole = InputMoments(5, TYPES)
    one_pass(a, stream, [whole])
    for stop, start, then in ((lambda new: new >= 2, 0, 2), (lambda new: True, 2, 3), (lambda new: True, 3, 4),
                              (None, 4, 5)):
        reader = InputMoments(5, TYPES, stop=stop)
        assert not cache.read(reader, stream)
        assert reader.start == start
        seen = counting_batches(reader)
        one_pass(a, stream, [reader])
        cache.write(reader, stream)
        assert reader.batches == then and seen == list(range(start, then))
        assert reader.partial is None  # (released once written)
    assert same_moments(reader.result, whole.result) and reader.tokens == whole.tokens
    assert all(torch.equal(reader.result[k][0], whole.result[k][0]) for k in whole.result)
    assert cache.read(InputMoments(5, TYPES), stream)  # whole now, and its partial entry gone
    assert not list(tmp_path.glob("*.partial.pt"))


def counting_batches(reader) -> list[int]:
    """The batches `reader` is given, in order (start_batch's)."""
    seen, real = [], reader.start_batch

    def start_batch(j):
        seen.append(j)
        real(j)

    reader.start_batch = start_batch
    return seen


def test_the_folder_keeps_its_newest_entries_within_its_bytes(tmp_path):
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    stream = stream_of(model, 6)
    readers = [InputMoments(n, TYPES) for n in (1, 2, 3)]
    one_pass(a, stream, readers)
    size = statistics.tensors_bytes(readers[0].result)
    cache = StatisticsCache(tmp_path, "model-key", max_bytes=int(2.5 * size) + 4096)
    paths = []
    for r in readers:
        cache.write(r, stream)
        paths.append(cache.path(r, stream))
    assert [p.exists() for p in paths] == [False, True, True]  # the oldest went to keep the folder within its bytes


def test_a_stats_cache_that_is_a_file_is_one_error_line(tmp_path, tiny_path, small_eval_file, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = engine_in_process("prune", "--model", str(tiny_path), "--units", "heads,channels", "--method", "flap",
                      "--eval-data", str(small_eval_file), "--max-windows", "1", "--out", str(tmp_path / "run"),
                             env={"PG_PRUNE_STATS_CACHE": str(blocker)})
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "PG_PRUNE_STATS_CACHE" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_run_the_budget_cut_leaves_its_sums_and_the_next_run_continues_them(
        caches, tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """A first run whose time budget stops the refit's statistics at 8 of 32 batches: its sums are kept; a second
    run on the same batches without the cut reads batches 8-31 alone, and ends on the model of a run that read all
    32 at once, weight for weight."""
    from engine.hooks.time_budget import TimeBudget

    budgeted = config_for(tiny_path, small_eval_file, "flap", method="pg", time_budget=1.0, reconstruct_batches=32,
                          init_batches=2)
    r = PruneRun(budgeted, tmp_path / "cut", model=tiny[0], tokenizer=tiny[1], log=(logged := []).append,
                 from_files=True)
    budget = next(h for h in r.res.hooks if isinstance(h, TimeBudget))
    budget.clock = lambda: r.res.started + 3600.0 + len(logged)  # (no time left: the statistics stop at their minimum)
    assert r.run(progress=False)["reconstruction"]["batches"] == 8
    assert len(list((caches / "statistics").glob("*.partial.pt"))) == 1
    plain = config_for(tiny_path, small_eval_file, "flap", method="pg", reconstruct_batches=32, init_batches=2)
    seen = counting(monkeypatch)
    planned = planned_caches(monkeypatch)
    second, logged = from_files(tiny, plain, tmp_path / "second")
    assert len(seen) == 32 - 8 and any("8 of 32 batches from the cache" in ln for ln in logged)
    # its plan counted the cut run's sums: the pass's forwards left, 24 of 32 (FLAP's column moments whole)
    assert planned[0]["statistics"] == pytest.approx(24 / 32)
    assert second["reconstruction"]["batches"] == 32 and not list((caches / "statistics").glob("*.partial.pt"))
    monkeypatch.setenv("PG_PRUNE_STATS_CACHE", "off")
    whole, _ = from_files(tiny, plain, tmp_path / "whole")
    wa, wb = weights(tmp_path / "second"), weights(tmp_path / "whole")
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and second["ppl_pruned"] == whole["ppl_pruned"]
