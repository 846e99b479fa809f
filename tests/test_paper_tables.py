"""bench/paper_tables.py: which runs the tables need, how they are shared and reported (no model runs here;
`python bench/paper_tables.py --model ../shared/models/tinystories-656k --steps 2 --max-windows 2` runs them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import paper_tables as pt  # noqa: E402

from engine.settings.config import PruneConfig  # noqa: E402

ARGS = argparse.Namespace(max_windows=8, eval_seqlen=128, init_batches=2, layer_init_batches=1, steps=5, lr=0.02, gumbel_lr=0.1, model="m",
                          device="cpu")


def test_every_cell_is_a_valid_run_config():
    args = ARGS
    for c in pt.cells({1, 2, 3, 4, 5}, [0, 1, 2]):
        ns = pt.cell_config(c, args, "m").resolved()
        assert ns.prune_ratio == c.rate and ns.seed == c.seed
        if c.pg:
            assert ns.lr == (0.1 if c.settings.get("method") == "gumbel" else 0.02) * c.lr_scale
        assert ns.init_batches == (1 if c.settings["units"] == "layers" else 2)


def test_pg_cells_run_the_papers_optimiser_unless_they_are_its_ablation():
    """N_s 2 and the moving-average baseline (not the tool's defaults) in every PG cell but table 4's rows
    that vary exactly these."""
    for c in pt.cells({1, 2, 3, 4, 5}, [0]):
        if c.pg and c.table != 4:
            config = pt.cell_config(c, ARGS, "m").resolved()
            assert config.num_mask_samples == 2, (c.table, c.row)
            if config.method == "pg":  # the baseline is an option of policy gradient (Gumbel-softmax has none)
                assert config.method_options["baseline"] == "moving-average", (c.table, c.row)


def test_only_picks_rows_by_name_and_refuses_an_unknown_one():
    todo = pt.cells({3}, [0])
    picked = pt.only_rows(todo, ["SLEB", "Layerwise-PPL"])
    assert picked and {c.row for c in picked} == {"SLEB", "Layerwise-PPL"}
    assert len(picked) == 6  # three rates each
    assert pt.only_rows(todo, None) == todo
    with pytest.raises(SystemExit, match="no row 'SLB'"):
        pt.only_rows(todo, ["SLB"])


def test_cells_with_the_same_settings_share_a_run():
    cells = pt.cells({1, 2, 4}, [0])
    paper_pg = {**pt.HC, "method": "pg", "scope": "global", "init": "wanda-sp", "num_mask_samples": 2,
                "baseline": "moving-average"}
    pg40 = [c for c in cells if c.rate == 0.4 and c.settings == paper_pg and c.lr_scale == 1.0]
    assert {c.table for c in pg40} == {1, 2, 4}  # one PG run at 40 % serves three tables
    assert len({pt.cell_key(c, ARGS) for c in pg40}) == 1
    assert len({pt.cell_key(c, ARGS) for c in cells}) < len(cells)
    # another budget is another run
    other = argparse.Namespace(**{**vars(ARGS), "steps": 6})
    assert pt.cell_key(pg40[0], other) != pt.cell_key(pg40[0], ARGS)
    # the same settings at another lr are another run
    halved = [c for c in cells if c.lr_scale != 1.0]
    assert halved and all(pt.cell_values(c, ARGS)["lr"] == 0.01 for c in halved)
    assert len({pt.cell_key(c, ARGS) for c in cells if c.settings == halved[0].settings}) == 2
    metric = next(c for c in cells if not c.pg)
    assert pt.cell_key(metric, other) == pt.cell_key(metric, ARGS)  # no steps in a one-shot cell


def test_report_means_and_stds_over_seeds():
    cells = [c for c in pt.cells({1}, [0, 1]) if c.rate == 0.3]
    fake = {}
    for c in cells:
        fake[pt.cell_key(c, ARGS)] = dict(ppl_dense=10.0, ppl_pruned=20.0 + c.seed * 2, eval_windows=8, seqlen=128,
                                          params_dense=2e6, params_pruned=1.5e6 if c.settings['scope'] == 'global' else 1.6e6)
    text = pt.report(cells, fake, ARGS)
    assert "| PG (global, Wanda-sp init) | 21.0 ± 1.4 [0,1] (1.5 M) |" in text
    assert "| Wanda-sp (uniform) | 20.0 [0] (1.6 M) |" in text
    assert "dense 2.0 M" in text
    assert "first 8 windows x 128 tokens (dense perplexity 10.00)" in text


def test_a_cell_that_another_live_process_runs_is_skipped(tmp_path):
    lock = tmp_path / "cell.lock"
    assert pt.claim(lock) is None and lock.read_text() == str(pt.os.getpid())  # free: ours
    lock.write_text(str(pt.os.getppid()))  # a live process holds it
    assert pt.claim(lock) == pt.os.getppid()
    c = pt.cells({4}, [0])[0]
    (tmp_path / f"{pt.cell_key(c, ARGS)}.lock").write_text(str(pt.os.getppid()))
    assert pt.run_cell(c, ARGS, tmp_path / "model", tmp_path) is None  # skipped, nothing run
    assert not (tmp_path / pt.cell_key(c, ARGS)).exists()
    # a lock left by a process that is gone is taken over
    import subprocess
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(str(dead.pid))
    assert pt.claim(lock) is None and lock.read_text() == str(pt.os.getpid())


def test_table_5_gives_every_seed_and_their_mean():
    cells = [c for c in pt.cells({5}, [0, 1]) if c.rate == 0.3]
    assert sorted((c.row, c.seed) for c in cells) == [("Gumbel-softmax", 0), ("Gumbel-softmax", 1), ("PG", 0), ("PG", 1)]
    fake = {pt.cell_key(c, ARGS): dict(ppl_dense=10.0, ppl_pruned=30.0 + 2 * c.seed, ppl_init=40.0, eval_windows=8,
                                       seqlen=128, params_dense=2e6, params_pruned=1.5e6, seconds_in_steps=5.0,
                                       seconds_per_step=1.0, peak_rss_mb=100.0) for c in cells}
    text = pt.report(cells, fake, ARGS)
    assert "| Gumbel-softmax | 30% | 32.0 | 40.0 | 5 | 1.00 | 100 | 1 |" in text
    assert "| Gumbel-softmax | 30% | **31.0 ± 1.4** | | | | | 0,1 |" in text


def test_a_row_run_once_takes_the_first_of_the_seeds():
    default, other = pt.cells({1, 2, 3, 4, 5}, [0, 1, 2]), pt.cells({1, 2, 3, 4, 5}, [3, 4, 5])
    assert len(other) == len(default)  # --seeds 3,4,5 drops no row
    # the PG rows of tables 1, 4 and 5 run every seed; tables 2 and 3 and the one-shot rows run once
    def multi(c):
        return c.table in (4, 5) or (c.table == 1 and c.row.startswith("PG"))
    assert {c.seed for c in other if not multi(c)} == {3}
    assert {c.seed for c in other if multi(c)} == {3, 4, 5}
    for row in {c.row for c in other if multi(c)}:
        assert {c.seed for c in other if c.row == row} == {3, 4, 5}, row


@pytest.mark.parametrize("args, message", [
    (["--tables", "7"], "table numbers 1 to 5"),
    (["--seeds", "x"], "seeds (integers >= 0)"),
    (["--rates", "0.3,1.5"], "prune ratios in (0, 1)"),
    (["--steps", "0"], "above 0"),
    (["--max-windows", "many"], "above 0"),
])
def test_bad_arguments_are_one_error_line(args, message, tmp_path):
    import subprocess
    proc = subprocess.run([sys.executable, str(pt.ROOT / "bench" / "paper_tables.py"), *args, "--out", str(tmp_path), "--list"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("paper_tables.py: error:") and message in proc.stderr


def test_the_comparison_tables_cells_are_valid_runs_and_its_docs_block_is_replaced(tmp_path):
    """bench/compare_table.py: every cell is a valid run config (a row's lr scale included), and --write-docs
    replaces only what stands between the markers."""
    import compare_table as ct

    for c in ct.cells([0.3, 0.5], [0, 1, 2]):
        ns = pt.cell_config(c, ARGS, "m").resolved()
        assert ns.prune_ratio == c.rate and ns.budget == "params"
        if c.pg:
            assert ns.lr == pytest.approx(0.02 * c.lr_scale)
    assert any(c.lr_scale != 1.0 for c in ct.cells([0.3], [0]))
    doc = tmp_path / "results.md"
    doc.write_text("head\n<!-- compare_table -->\nold table\n<!-- /compare_table -->\ntail\n")
    ct.write_docs("protocol\n\n| a | b |\n\nRemoved (parameters, % of the decoder) per cell:\n- x\n", doc)
    assert doc.read_text() == "head\n<!-- compare_table -->\nprotocol\n\n| a | b |\n<!-- /compare_table -->\ntail\n"


def test_the_comparison_cells_configs_live_in_one_file_and_come_back_into_a_cell(tmp_path):
    """Git keeps compare_table's cell configs in configs.json (not one file a cell): cell_configs merges the
    finished cells' own over it, and cell_config_file writes a fresh clone's cell config back from it, equal."""
    import json

    import compare_table as ct

    cells = tmp_path / "cells"
    for name, done in (("a-cell", True), ("b-cell", False)):
        (cells / name).mkdir(parents=True)
        (cells / name / "config.json").write_text(json.dumps({"seed": len(name), "name": name}))
        if done:
            (cells / name / "results.json").write_text("{}")
    (tmp_path / ct.CONFIGS_FILE).write_text(json.dumps({"old-cell": {"seed": 7}}))
    merged = ct.cell_configs(cells)
    assert merged == {"old-cell": {"seed": 7}, "a-cell": {"seed": 6, "name": "a-cell"}}  # (b-cell never finished)
    (tmp_path / ct.CONFIGS_FILE).write_text(json.dumps(merged))
    (cells / "a-cell" / "config.json").unlink()  # a fresh clone: git brought results.json, not config.json
    back = ct.cell_config_file(cells / "a-cell")
    assert json.loads(back.read_text()) == {"seed": 6, "name": "a-cell"}
    assert ct.cell_config_file(cells / "b-cell") == cells / "b-cell" / "config.json"  # (its own, untouched)
    with pytest.raises(FileNotFoundError):
        ct.cell_config_file(cells / "no-such-cell")
    real = ct.ROOT / "bench" / "results" / "compare_table"
    kept = json.loads((real / ct.CONFIGS_FILE).read_text())
    assert all(PruneConfig.from_dict(dict(kept[d.name])) for d in (real / "cells").iterdir()
               if (d / "results.json").is_file())  # every finished cell of the table has its config in git


def test_a_cell_started_in_another_clone_is_cleared_and_anything_else_is_kept(tmp_path):
    started = tmp_path / "cell"  # what git brings back of a started cell: its kept files, no checkpoint, no marker
    started.mkdir()
    for name in pt.KEPT_IN_GIT:
        (started / name).write_text("{}")
    pt.clear_started(started)
    assert started.is_dir() and not list(started.iterdir())
    other = tmp_path / "other"  # a folder with anything more (a user's file, a run's marker) is not touched
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "notes.txt").write_text("mine")
    pt.clear_started(other)
    assert sorted(p.name for p in other.iterdir()) == ["config.json", "notes.txt"]
    pt.clear_started(tmp_path / "missing")  # a cell never started: nothing to do
