"""bench/cpu_curve.py (issue 28's quality per CPU minute): its cells are the protocol with one setting
changed, its curve reads the exported mask at a CPU minute, and one real cell runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import cpu_curve as cc  # noqa: E402

from engine.settings.config import FAST, PruneConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT.parent / "shared" / "models" / "tinystories-656k"


def test_each_variant_is_the_default_protocol_with_its_own_settings_changed():
    base = cc.cell_config("default", 0, 15).to_dict()
    assert base["time_budget"] == 15 and base["max_windows"] == cc.EVAL_WINDOWS and base["init"] == "flap"
    defaults = PruneConfig(**FAST).resolved().to_dict()  # everything else is the fast preset's (the curve's run)
    assert {k for k in base if base[k] != defaults[k]} <= set(cc.PROTOCOL) | {"time_budget"}
    for name, (_, overrides) in cc.VARIANTS.items():
        config = cc.cell_config(name, 1, 15).to_dict()
        changed = {k for k in config if config[k] != base[k]} - {"seed"}
        assert changed == {k for k, v in overrides.items() if v != base[k]}, name
        assert changed or name == "default", name  # (a variant may spell out a default it relies on)
        assert config["seed"] == 1


def test_the_curve_reads_the_mask_exported_by_a_cpu_minute():
    curve = [{"cpu": 100.0, "ppl": 300.0}, {"cpu": 160.0, "ppl": 280.0}, {"cpu": 220.0, "ppl": 250.0}]
    assert cc.ppl_at(curve, 99.0) is None
    assert cc.ppl_at(curve, 100.0) == 300.0
    assert cc.ppl_at(curve, 219.9) == 280.0
    assert cc.ppl_at(curve, 1e6) == 250.0  # a finished run keeps its final mask


def _cell(out: Path, variant: str, seed: int, curve: list[tuple[float, float]], vals: list[float]) -> None:
    """A finished cell whose every step was checked (held-out perplexities `vals`, the init's first) and was the
    best so far (best-val without a margin exported each step's mask: `curve` holds their test perplexities)."""
    d = out / "cells" / f"{variant}-s{seed}"
    (d / "run").mkdir(parents=True)
    (d / "run" / "results.json").write_text(json.dumps({"val_ppl_init": vals[0]}))
    (d / "trace.jsonl").write_text("".join(json.dumps({"step": i, "val_ppl": v if i else None}) + "\n"
                                           for i, v in enumerate(vals)))
    points = [{"step": i, "cpu": 60 * m, "ppl": p, "best_step": i} for i, (m, p) in enumerate(curve)]
    (d / "cell.json").write_text(json.dumps({
        "variant": variant, "seed": seed, "steps": len(curve) - 1, "seconds_per_step": 20.0, "cpu_start": 60 * curve[0][0],
        "cpu_total": 60 * curve[-1][0], "ppl_final": curve[-1][1], "curve": points}))


def test_the_report_gives_seed_means_at_the_marks_and_the_plot_a_line_per_variant(tmp_path):
    _cell(tmp_path, "default", 0, [(3, 300.0), (9, 240.0), (15, 230.0)], [100.0, 99.5, 98.0])
    _cell(tmp_path, "default", 1, [(4, 320.0), (10, 260.0), (15, 250.0)], [100.0, 99.5, 99.2])
    _cell(tmp_path, "ns2", 0, [(3, 310.0), (12, 200.0)], [100.0, 90.0])
    table = cc.report(tmp_path, [5.0, 14.0])
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert set(rows) == {"default", "ns2"}
    # with a 1 % margin seed 0 still takes step 2 (2 % below the init) and seed 1 keeps its init (0.8 %)
    assert "| 310.0 ± 14.1 | 250.0 ± 14.1 | **240.0 ± 14.1** (15.0) | 275.0 ± 63.6 |" in rows["default"]
    assert "| 310.0 | 200.0 | **200.0** (12.0) | 200.0 |" in rows["ns2"]
    svg = cc.svg(tmp_path)
    assert svg.count("<path") == 2 and "default (2 seeds)" in svg and "ns2 (1 seed)" in svg


@pytest.mark.skipif(not TINY.is_dir(), reason="needs ../shared/models/tinystories-656k")
def test_a_real_cell_traces_its_run_and_ends_on_its_final_mask(tmp_path):
    """Two variants on the 2-layer real model with a budget of a few seconds: the curve's CPU times grow,
    its last point is the run's final mask on the protocol's windows, and eval64's run evaluated on 64."""
    cmd = [sys.executable, str(ROOT / "bench" / "cpu_curve.py"), "--model", str(TINY), "--minutes", "0.25",
           "--seeds", "0", "--variants", "default,eval64", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for variant in ("default", "eval64"):
        cell = json.loads((tmp_path / "cells" / f"{variant}-s0" / "cell.json").read_text())
        cpus = [p["cpu"] for p in cell["curve"]]
        assert cpus == sorted(cpus) and len(cpus) == cell["steps"] + 1
        assert cell["curve"][-1]["best_step"] == cell["mask_step"]
        assert cell["curve"][-1]["ppl"] == cell["ppl_final"]
        assert not (tmp_path / "cells" / f"{variant}-s0" / "run" / "model").exists()
        run = json.loads((tmp_path / "cells" / f"{variant}-s0" / "run" / "results.json").read_text())
        assert run["eval_windows"] == (64 if variant == "eval64" else cc.EVAL_WINDOWS)
        if variant == "default":
            assert cell["ppl_final_run"] == pytest.approx(cell["ppl_final"], rel=1e-6)
    assert (tmp_path / "curve.svg").read_text().count("<path") == 2
