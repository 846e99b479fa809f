"""Issue 49 in a real browser (headless Chromium, `streamlit run app.py` on the tiny model): the KV-group heatmap's
✓/✗ are the run's own masks, live, saved and at its init. Apart from tests/test_browser.py so that the two longest
browser tests run on different xdist workers (--dist loadfile keeps a file on one).

Needs what tests/test_browser.py needs (Chromium, chromium-driver, selenium); marked browser.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_browser import (SLOW, browser, button, by_label, check_contrast, click_text,  # noqa: E402,F401
                          click_when_free, fill_form, heatmap_reading, marks_of, newest_run, open_expander, page_text,
                          planned_removal, saved_head_mask, serve, set_input, shown_step_masks, start_run, status_line, wait)
from selenium.webdriver.common.by import By  # noqa: E402  (after test_browser: it skips without Chromium)

pytestmark = pytest.mark.browser


def test_browser_heatmap_marks_are_the_runs_masks(browser):
    """Issue 49: on the page's defaults (KV groups and channels on one parameter budget, 30 %), the heatmap's ✓/✗ read
    from the page's Plotly figure are the run's own masks, cell by cell: during a run the hard mask of the step the
    page shows (metrics.jsonl), at the end masks.safetensors' final mask, and its init mask on the toggle. (The app
    once redrew the KV groups' mask on their own budget: 6 of 8 kept where the run kept 7.)"""
    d = browser
    with serve() as (url, runs):
        d.get(url)
        wait(lambda: "Prune" in d.find_element(By.TAG_NAME, "h1").text, timeout=90 * SLOW, what="the Prune page")
        wait(lambda: "No run yet" in page_text(d), timeout=180 * SLOW, what="the empty run panel")  # (the plan first)
        assert by_label(d, "Pruning rate").get_attribute("value") == "0.3"
        fill_form(d, steps=5000)
        start_run(d, timeout=180)  # (both browser tests at once: 60 s was short)
        wait(lambda: "Running" in status_line(d) and heatmap_reading(d), timeout=300 * SLOW, what="the live heatmap")
        run = newest_run(runs)
        config = json.loads((run / "config.json").read_text())
        assert config["budget"] == "params" and config["units"] == ["kv_groups", "channels"] and config["prune_ratio"] == 0.3
        seen = set()
        while len(seen) < 2:  # two different steps while it runs: the marks follow the run's own masks
            step, marks, want = shown_step_masks(d, run)
            assert marks == want, (step, marks, want)
            seen.add(step)
        assert "Running" in status_line(d)
        button(d, "Stop").click()
        wait(lambda: "Stopped" in status_line(d), timeout=60 * SLOW, what="the run to stop")

        open_expander(d, "Run settings")
        set_input(d, "Steps", 4)
        wait(lambda: planned_removal(d, 4), what="the plan of the short run")
        button(d, "Start pruning").click()
        wait(lambda: "Done" in status_line(d) and "final (" in page_text(d), timeout=300 * SLOW, what="the run to end")
        run = newest_run(runs)
        results = json.loads((run / "results.json").read_text())
        from engine.ui.masks import mask_source

        assert mask_source(results) in page_text(d)  # which step the final mask is from
        final = wait(lambda: heatmap_reading(d), what="the final heatmap")
        assert marks_of(final) == saved_head_mask(run)
        check_contrast(final)
        click_text(d, "init (step 0)", "p")
        init = wait(lambda: (r := heatmap_reading(d)) and "init hard mask" in d.execute_script(
            "return Array.from(document.querySelectorAll('.js-plotly-plot')).map(e => e.layout.title.text).join(' ')")
            and r, what="the init mask")
        assert marks_of(init) == saved_head_mask(run, "init_masks")

