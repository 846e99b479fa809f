"""Compare in a real browser (headless Chromium, `streamlit run app.py`), on fake run folders written by the engine's
own writers (tests/test_compare_page.py's make_run): a link picks the runs, a reload keeps them, the table's key
columns and the run names are in view at 1400 px and at 1000 px, and each run has one colour in every chart, read
from the page's Plotly figures. Screenshots: compare-runs-1400.png and compare-runs-1000.png (assets/screenshots/
with PG_PRUNE_REFRESH_ASSETS=1; else a temporary folder).

Needs what tests/test_browser.py needs (Chromium, chromium-driver, selenium); marked browser.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_browser import HEIGHT, KEY_COLUMNS, browser, page_text, serve, shot, table_columns, wait  # noqa: E402,F401
from test_compare_page import make_run  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402  (after test_browser: it skips without Chromium)

pytestmark = pytest.mark.browser


def run_colours(d) -> dict[str, set[str]]:
    """Trace name -> the colours it is drawn in, over every Plotly figure on the page."""
    found = d.execute_script("""
        const out = [];
        for (const el of document.querySelectorAll('.js-plotly-plot'))
            for (const t of (el.data || []))
                out.push([t.name || '', (t.line && t.line.color) || (t.marker && t.marker.color) || '']);
        return JSON.stringify(out);""")
    colours: dict[str, set[str]] = {}
    for name, colour in json.loads(found):
        if " · " in name and isinstance(colour, str):
            colours.setdefault(name, set()).add(colour)
    return colours


def test_compare_link_reload_columns_and_colours_at_1400_and_1000_px(browser):
    d = browser
    with serve() as (url, runs):
        make_run(runs, "a-global", losses=[[3.0, 2.8], [2.6, 2.4], [2.2, 2.0]], val={2: 30.0, 3: 27.0}, age=1)
        make_run(runs, "a-uniform", scope="uniform", ppl_pruned=33.5, age=2)
        make_run(runs, "live-run", steps=50, finished=False, losses=[[3.5, 3.4]], age=3)
        d.set_window_size(1400, HEIGHT)
        d.get(url)  # (the server's first page load runs app.py, which lists the pages)
        wait(lambda: "Prune" in d.find_element(By.TAG_NAME, "h1").text, timeout=300, what="the Prune page")  # (slow on loaded cores)
        d.get(f"{url}/compare?runs=live-run,a-global,a-uniform")
        head = "A live-run: global, 30%, incomplete"
        wait(lambda: head in page_text(d), timeout=120, what="the picked runs")
        text = page_text(d)
        assert "B a-global: global" in text and "C a-uniform: uniform" in text
        wait(lambda: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) >= 5, what="the charts")
        colours = wait(lambda: (c := run_colours(d)) and len(c) == 3 and c, what="three runs in the charts")
        assert all(len(c) == 1 for c in colours.values()), colours  # one colour per run, in every chart
        assert len({next(iter(c)) for c in colours.values()}) == 3
        header = wait(lambda: table_columns(d)[0], what="the runs table")
        assert "run" in header and all(c in header for c in KEY_COLUMNS), header
        shot(d, "compare-runs-1400", plots=4)
        d.refresh()  # a reload keeps the pick (the URL holds it)
        wait(lambda: head in page_text(d), timeout=60, what="the pick after a reload")
        assert "runs=live-run" in d.current_url.replace("%2C", ",")
        d.set_window_size(1000, HEIGHT)
        time.sleep(1.5)
        header = wait(lambda: table_columns(d)[0], what="the runs table at 1000 px")
        assert "run" in header and "scope" in header, header
        cells = d.execute_script("""
            return Array.from(document.querySelectorAll('[data-testid="stDataFrame"]')[0]
                .querySelectorAll('table td, [role=gridcell]')).map(e => e.textContent.trim());""")
        assert any(c == "a-uniform" for c in cells), cells[:20]  # the names are shown whole
        shot(d, "compare-runs-1000", plots=4)
