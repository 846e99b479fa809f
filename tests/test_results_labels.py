"""Issue 66: the Results tab names each figure by what it is. A run's best-val figure under --reward kl is a mean KL
(nats a token), never a "ppl" (the quickstart's 0.8036 had been shown as "best val ppl"); the removed count and
dense − pruned reconcile through the compensation's biases; phases are listed with their unit, not as raw keys."""

from __future__ import annotations

from engine.ui.settings import compensation_biases, fmt_result, results_table

RESULTS = {"reward": "kl", "best_val": {"metric": "kl", "value": 0.8036}, "ppl_dense": 56.35, "ppl_pruned": 143.3012, "val_ppl_init": None,
           "params_dense": 134_515_008, "params_pruned": 102_685_824, "params_removed": 31_861_440,
           "seconds_by_phase": {"load": 40.0, "statistics": 186.2, "other": 0.4, "total": 582.0}, "peak_rss_mb": 2300.0}


def rows(results) -> dict[str, str]:
    return {r["result"]: r["value"] for r in results_table(results)}


def test_a_kl_runs_best_val_figure_is_named_a_kl_and_never_a_perplexity():
    shown = rows(RESULTS)
    assert shown["best-val's held-out mean KL from the dense model"] == "0.8036 nats a token"
    assert not any("ppl" in k or "perplexity" in k for k, v in shown.items() if v.startswith("0.8036"))
    assert not any(k == "best val ppl" for k in shown)
    ce = rows({**RESULTS, "reward": "ce", "best_val": {"metric": "perplexity", "value": 151.234}})
    assert ce["best-val's held-out perplexity"] == "151.23"


def test_the_removed_count_and_dense_less_pruned_reconcile_through_the_compensations_biases():
    # the quickstart's figures: 28 kept layers x 2 output projections x 576 biases = 32,256
    assert compensation_biases(RESULTS) == 32_256 == 28 * 2 * 576
    shown = rows(RESULTS)
    biases = next(v for k, v in shown.items() if k.startswith("output biases the bias compensation adds"))
    assert biases == "32,256 (dense − pruned: 31,829,184)"
    assert compensation_biases({**RESULTS, "params_pruned": 134_515_008 - 31_861_440}) == 0
    assert not any(k.startswith("output biases") for k in rows({**RESULTS, "params_pruned": 102_653_568}))
    assert compensation_biases({"params_removed": 5}) is None  # (a results.json without the counts)


def test_figures_carry_their_unit_and_one_missing_value_mark():
    shown = rows(RESULTS)
    assert shown["perplexity of the pruned model"] == "143.30"
    assert shown["wall seconds by phase"] == "load 40 s, statistics 186 s (total 582 s)"
    assert shown["peak memory (resident)"] == "2.25 GB" and fmt_result("mb", 900.0) == "900 MB"
    assert shown["held-out perplexity of the init mask (calibration text)"] == "—"
    assert all(v != "None" for v in shown.values())


def test_the_runs_tables_row_leads_with_the_runs_name_and_rounds_with_one_missing_mark():
    """Issue 66: the run's name was the last column (off-screen at 1400 px: two rows read the same), "ppl pruned"
    showed raw floats (551.5698) and a missing value "None" beside "—"."""
    from engine.ui.settings import runs_row

    config = {"scope": "global", "prune_ratio": 0.3, "steps": 40, "model": "/x/tinystories-656k", "units": ["kv_groups"]}
    done = runs_row("r-a", "done", config, {"ppl_pruned": 551.5698, "ppl_dense": None, "params_pruned": 538_240,
                                            "removed_of_decoder": 0.3}, 6, "2026-12-01 19:00", "1.21× est.")
    assert list(done)[:6] == ["run", "status", "scope", "rate", "ppl pruned", "params"]
    assert done["run"] == "r-a" and done["ppl pruned"] == "551.57" and done["ppl dense"] == "—"
    assert done["params"] == "538 k" and done["removed"] == "30.0% of decoder" and done["steps"] == "6/40"
    running = runs_row("r-b", "running", {}, None, 0, "2026-12-01 19:01", "—")
    assert all(v not in (None, "None") for v in running.values())
    assert running["ppl pruned"] == running["params"] == running["removed"] == running["model"] == "—"
