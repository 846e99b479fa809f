"""Issue 66 in a real browser (headless Chromium, `streamlit run app.py` on the tiny model): the progress line of a
run slowed on purpose says that the phase is over its plan and names the check that is running; a KL run's Results
tab names its held-out figure as a KL, never as a perplexity. Apart from tests/test_browser.py so that the browser
tests spread over xdist workers (--dist loadfile keeps a file on one).

Needs what tests/test_browser.py needs (Chromium, chromium-driver, selenium); marked browser.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_browser import (ROOT, SLOW, TINY, browser, button, fill_form, page_text, pick_run,  # noqa: E402,F401
                          serve, start_run, status_line, wait)
from selenium.webdriver.common.by import By  # noqa: E402  (after test_browser: it skips without Chromium)

pytestmark = pytest.mark.browser
CALIB = ROOT.parent / "shared" / "data" / "c4" / "c4-en.llamafactory-c4_demo.300.text-only.json.gz"


def progress_text(d) -> str:
    """The job's progress line(s) as the page draws them (st.progress's text)."""
    return " ".join(e.text for e in d.find_elements(By.CSS_SELECTOR, '[data-testid="stProgress"]'))


def test_a_slowed_check_is_named_and_over_its_plan_in_the_browser(browser, monkeypatch):
    """$PG_PRUNE_SLOW_PHASE makes every held-out check sleep 15 s: while one runs, the page's progress line names it
    ("a held-out check running for ...") and says how far over its plan it is ("... × the plan")."""
    from engine.run.phases import SLOW_ENV

    monkeypatch.setenv(SLOW_ENV, "validation:15")  # (serve() hands the server this process's environment)
    d = browser
    with serve() as (url, runs):
        d.get(url)
        wait(lambda: "Prune" in d.find_element(By.TAG_NAME, "h1").text, timeout=90 * SLOW, what="the Prune page")
        wait(lambda: "No run yet" in page_text(d), timeout=180 * SLOW, what="the empty run panel")
        fill_form(d, steps=40)  # (a check every 10 steps: its 15 s are far over the plan's fraction of a second)
        start_run(d, timeout=180)
        def over_plan():
            text = progress_text(d)
            return text if "a held-out check running for" in text and "× the plan" in text else None

        line = wait(over_plan, timeout=300 * SLOW, what="a named check over its plan")
        assert re.search(r"validation: [^,]+, [\d.]+× the plan", line), line
        assert "Running" in status_line(d)
        button(d, "Stop").click()
        wait(lambda: "Stopped" in status_line(d) or "Done" in status_line(d), timeout=120 * SLOW, what="the stop")


def visible_table_rows(d) -> list[list[str]]:
    """Every row of the tables (st.dataframe) shown now, read from their accessibility tables while each grid is
    scrolled from top to bottom (a grid lays out only the rows in view)."""
    rows: list[list[str]] = []
    for grid in d.find_elements(By.CSS_SELECTOR, '[data-testid="stDataFrame"]'):
        if not grid.is_displayed():  # (another tab's table)
            continue
        last = None
        for top in range(0, 20000, 100):
            at = d.execute_script("const s = arguments[0].querySelector('.dvn-scroller'); if (!s) return -1;"
                                  "s.scrollTop = arguments[1]; return s.scrollTop;", grid, top)
            time.sleep(0.6)  # (the grid lays out the rows now in view on its next frames)
            rows += [r for r in d.execute_script("""
                return Array.from(arguments[0].querySelectorAll('table tr')).map(
                    r => Array.from(r.querySelectorAll('td, [role=gridcell]')).map(e => e.textContent.trim()));""",
                                                 grid) if r and r not in rows]
            if at == last or at < 0:  # (the grid's end: it scrolled no further)
                break
            last = at
    return rows


def test_a_kl_runs_results_tab_names_its_kl_as_a_kl(browser):
    """A finished run under --reward kl with held-out checks: its Results tab shows best-val's figure as the mean KL
    from the dense model (nats a token), and no label of its values says "ppl" or "perplexity" for it."""
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun

    d = browser
    with serve() as (url, runs):
        run = runs / "kl-run"
        PruneRun(PruneConfig(model=str(TINY), units=["kv_groups", "channels"], method="pg", reward="kl", steps=4, val_every=2,
                             val_batches=1, max_windows=2, init_batches=1, batch_size=2, seqlen=32, eval_seqlen=32,
                             num_mask_samples=2, calib=str(CALIB), prune_ratio=0.3),
                 run, log=lambda m: None).run(progress=False)
        results = json.loads((run / "results.json").read_text())
        assert results["reward"] == "kl" and results["best_val"]["metric"] == "kl", results
        d.get(f"{url}/runs")
        wait(lambda: "Delete run" in page_text(d), timeout=120 * SLOW, what="the Runs page")
        pick_run(d, "kl-run")
        tab = wait(lambda: [t for t in d.find_elements(By.CSS_SELECTOR, '[role="tab"]') if t.text.strip() == "Results"],
                   what="the Results tab")[0]
        tab.click()
        kl_label = "best-val's held-out mean KL from the dense model"
        seen: list = []

        def kl_rows():
            seen[:] = visible_table_rows(d)
            return seen if any(kl_label in r for r in seen) else None

        try:
            rows = wait(kl_rows, timeout=60 * SLOW, what="the Results table's KL row")
        except AssertionError as e:
            raise AssertionError(f"{e}; the tables' rows: {seen}") from None
        value = next(r[1] for r in rows if r[0] == kl_label)
        assert value.endswith("nats a token") and float(value.split()[0]) == pytest.approx(results["best_val"]["value"],
                                                                                            abs=1e-4), value
        # no row names that KL a perplexity: the rows that say ppl or perplexity hold the evaluations' perplexities
        for label, shown in (r[:2] for r in rows if len(r) >= 2):
            if "ppl" in label or "perplexity" in label:
                assert shown != value and "nats" not in shown, (label, shown)
        assert "best val ppl" not in page_text(d)
        time.sleep(0.2)
