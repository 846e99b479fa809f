"""Recovery in a real browser (headless Chromium, `streamlit run app.py` on the tiny model): on a finished run,
Recover distils its export from the dense model with the loss drawn live, the page says where the recovered model
is, and Chat then answers with the dense, the pruned and the recovered model side by side. Apart from
tests/test_browser.py so that the browser tests spread over xdist workers (--dist loadfile keeps a file on one).

Needs what tests/test_browser.py needs (Chromium, chromium-driver, selenium); marked browser.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_browser import (ROOT, SLOW, TINY, browser, button, click_when_free, goto, page_text,  # noqa: E402,F401
                          serve, set_input, shot, wait)
from selenium.webdriver.common.by import By  # noqa: E402  (after test_browser: it skips without Chromium)
from selenium.webdriver.common.keys import Keys  # noqa: E402

pytestmark = pytest.mark.browser
CALIB = ROOT.parent / "shared" / "data" / "c4" / "c4-en.llamafactory-c4_demo.300.text-only.json.gz"


def answers_with_speed(d) -> list[str]:
    """The chat's captions that carry a model's tokens/s: one per model that answered."""
    return [e.text for e in d.find_elements(By.CSS_SELECTOR, '[data-testid="stCaptionContainer"]') if "tokens/s" in e.text]


def test_recover_a_finished_run_watch_its_loss_and_chat_with_three_models(browser):
    from engine.run.loop import PruneRun
    from engine.settings.config import PruneConfig
    from engine.ui.paths import URL_RUN_KEY

    d = browser
    with serve() as (url, runs):
        run = runs / "to-recover"
        PruneRun(PruneConfig(model=str(TINY), units=["kv_groups", "channels"], steps=2, max_windows=2, init_batches=1,
                             batch_size=2, seqlen=32, eval_seqlen=32, num_mask_samples=2, calib=str(CALIB),
                             prune_ratio=0.3), run, log=lambda m: None).run(progress=False)
        d.get(f"{url}/?{URL_RUN_KEY}=to-recover")  # (Prune, the default page, showing that run: a shared link)
        wait(lambda: "Prune" in d.find_element(By.TAG_NAME, "h1").text, timeout=90 * SLOW, what="the Prune page")
        wait(lambda: "Recover · the pruned model fine-tuned on the text (CE), LoRA" in page_text(d), timeout=60 * SLOW,
             what="the Recover panel of the finished run")
        set_input(d, "Minutes", 0.1)
        click_when_free(d, button(d, "Recover"))

        def finished():
            text = page_text(d)
            assert "Recovery failed" not in text, text[-2000:]
            return "the recovered model is in" in text

        wait(finished, timeout=300 * SLOW, what="the recovery to finish")
        charts = " ".join(e.get_attribute("outerHTML") for e in d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot"))
        assert "Recovery: loss per step" in charts, "no recovery loss chart on the page"
        shot(d, "recover-done", plots=1)
        res = json.loads((run / "recover" / "recover_results.json").read_text())
        assert res["steps"] >= 1 and (run / "recover" / "model" / "config.json").is_file()

        goto(d, "Chat")  # (the run chosen on Runs is Chat's too)
        wait(lambda: "Also the recovered model" in page_text(d), timeout=60 * SLOW, what="the recovered model's toggle")
        box = wait(lambda: d.find_element(By.CSS_SELECTOR, '[data-testid="stChatInputTextArea"]'), what="the chat input")
        box.send_keys("Once upon a time, there was a")
        box.send_keys(Keys.ENTER)
        captions = wait(lambda: (c := answers_with_speed(d)) and len(c) == 3 and c, timeout=120 * SLOW,
                        what="three answers: dense, pruned, recovered")
        assert all(int(c.split(" tokens")[0]) > 0 for c in captions), captions
        assert "Recovered · fine-tuned on the text (CE), LoRA" in page_text(d)
        shot(d, "chat-recovered")
