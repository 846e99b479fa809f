"""End to end in a real browser: headless Chromium drives `streamlit run app.py` on the tiny model.

Moves the rate slider, starts a run, waits for the KV-group heatmap to change, stops the run,
finishes a short run, starts the matching uniform run from Compare, asks the chat a question
and reads both answers. Screenshots of every page go to a fresh temporary folder (pg-prune-shots-*);
`PG_PRUNE_REFRESH_ASSETS=1` writes them to assets/screenshots/ instead, to refresh the README's images.

Needs the Debian packages chromium and chromium-driver (.ci/run installs them) and selenium.

`PG_PRUNE_BROWSER_MODEL=default python -m pytest -q -s tests/test_browser.py` runs the same test on the
default model (SmolLM2-135M-Instruct, the paper's batch 8 x 128 tokens, 32 evaluation windows) and
with PG_PRUNE_REFRESH_ASSETS=1 writes its screenshots to assets/screenshots/default/ (about 20 minutes on 2 CPU
cores; not run in CI).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT.parent / "shared" / "models" / "tinystories-656k"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
REAL = os.environ.get("PG_PRUNE_BROWSER_MODEL", "") == "default"
REFRESH_ASSETS = os.environ.get("PG_PRUNE_REFRESH_ASSETS", "") == "1"  # an explicit choice: the repository's images
SHOTS = ((ROOT / "assets" / "screenshots") if REFRESH_ASSETS else Path(tempfile.mkdtemp(prefix="pg-prune-shots-"))) \
    / ("default" if REAL else "")
pytestmark = pytest.mark.browser
SLOW = 30 if REAL else 1  # wait this many times longer on the real model (2 shared CPU cores)

if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip(f"Chromium not installed ({CHROMIUM}, {CHROMEDRIVER}): apt-get install chromium chromium-driver",
                allow_module_level=True)
if not TINY.is_dir():
    pytest.skip(f"tiny model not found at {TINY}", allow_module_level=True)
selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -r requirements.txt)")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

WIDTH, HEIGHT = 1100, 1900
DOWNLOADS = Path(tempfile.mkdtemp(prefix="pg-prune-downloads-"))  # where the browser saves the app's downloads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    with serve() as found:
        yield found


@contextlib.contextmanager
def serve():
    """`streamlit run app.py` on a free port with a fresh runs folder: (url, runs folder)."""
    port = free_port()
    runs = Path(tempfile.mkdtemp(prefix="app-runs-"))
    env = {**os.environ, "PG_PRUNE_RUNS_DIR": str(runs), "TOKENIZERS_PARALLELISM": "false"}
    log = open(runs.parent / f"streamlit-{port}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port", str(port),
         "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"streamlit did not start: {(runs.parent / f'streamlit-{port}.log').read_text()}")
            time.sleep(0.5)
        yield url, runs
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(runs, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    DOWNLOADS.mkdir(exist_ok=True)  # (another module's browser, made from this fixture, removed it at its end)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}"):
        opts.add_argument(flag)
    opts.add_experimental_option("prefs", {"download.default_directory": str(DOWNLOADS),
                                           "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_window_size(WIDTH, HEIGHT)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(DOWNLOADS)})
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
    shutil.rmtree(DOWNLOADS, ignore_errors=True)


# --- helpers ----------------------------------------------------------------------------------
def wait(cond, timeout=60.0, what="condition"):
    end = time.time() + timeout
    last_exc = None
    while time.time() < end:
        try:
            value = cond()
            if value:
                return value
        except Exception as e:  # elements come and go while Streamlit redraws
            last_exc = e
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what} ({last_exc!r})")


def page_text(d) -> str:
    return d.find_element(By.TAG_NAME, "body").text


def by_label(d, label: str, tag: str = "input"):
    return wait(lambda: d.find_element(By.CSS_SELECTOR, f'{tag}[aria-label="{label}"]'), what=f"input '{label}'")


def click_when_free(d, el) -> None:
    """Click, retrying while a redraw (a fragment tick on a busy machine) covers the element."""
    def attempt():
        d.execute_script("arguments[0].scrollIntoView({block: 'center'});", el)
        el.click()  # raises while covered; wait() retries
        return True

    wait(attempt, timeout=30 * SLOW, what="a clickable element")


def _confirm_buttons(d) -> list:
    return [b for b in d.find_elements(By.TAG_NAME, "button") if "Yes, start it" in b.text and b.is_displayed()]


def _started(d) -> bool:
    return "Running" in status_line(d) or "Loading" in status_line(d)


def start_run(d, timeout: float = 120) -> None:
    """Press Start pruning and wait until the run starts or the page asks first ("Yes, start it" is then pressed).
    The button is pressed once it is enabled; if nothing happens it is pressed again while the page still offers it
    (CI once lost the first click: a rerun from the last typed setting redrew the button under it)."""
    end = time.time() + timeout * SLOW
    while True:
        el = wait(lambda: [b for b in d.find_elements(By.TAG_NAME, "button")
                           if "Start pruning" in b.text and b.is_displayed() and b.is_enabled()],
                  what="an enabled Start pruning")[0]
        click_when_free(d, el)
        try:
            asked = wait(lambda: _confirm_buttons(d) or _started(d),
                         timeout=min(30 * SLOW, max(end - time.time(), 1)), what="the start")
            break
        except AssertionError:
            if time.time() >= end:
                raise
    if isinstance(asked, list):  # estimated over 10 minutes: the page asks first
        wait(lambda: _click_confirm(d), timeout=60 * SLOW, what="the confirmation")


def _click_confirm(d) -> bool:
    """Press "Yes, start it" if the page shows it; True once pressed or once the run has started."""
    asked = _confirm_buttons(d)
    if asked:
        asked[0].click()
        return True
    return _started(d)


def same_value(shown: str | None, value) -> bool:
    try:
        return float(shown) == float(value)
    except (TypeError, ValueError):
        return shown == str(value)


def set_input(d, label: str, value) -> None:
    """Type a value into an input and wait until the page holds it, retyping while a rerun redraws the input (on a
    fresh machine the first reruns are slow, and an input disabled by the radio above it is enabled by the next
    rerun: typing into it early raised 'element not interactable' in CI)."""
    def attempt():
        el = by_label(d, label)
        if not el.is_enabled():
            return False
        if not el.is_displayed():  # (an expander around it closed by a redraw on a loaded machine: CI's 'not interactable')
            for details in el.find_elements(By.XPATH, "ancestor::details[not(@open)]"):  # (outermost first)
                click_when_free(d, details.find_element(By.XPATH, "./summary"))
            return False
        d.execute_script("arguments[0].scrollIntoView({block: 'center'});", el)
        el.click()
        el.send_keys(Keys.CONTROL, "a")
        el.send_keys(str(value))
        el.send_keys(Keys.TAB)
        return wait(lambda: same_value(by_label(d, label).get_attribute("value"), value), timeout=10 * SLOW,
                    what=f"'{label}' at {value}")

    wait(attempt, timeout=60 * SLOW, what=f"input '{label}' set to {value}")


def slide_to(d, label: str, target: float) -> None:
    """Move a slider to target with the keyboard on its thumb, one key at a time: each key reruns the page, and a key
    sent while that rerun redraws the slider is lost (CI's fresh machine ended at 0.45 after four keys from 0.30)."""
    for _ in range(100):
        el = by_label(d, label)
        shown = float(el.get_attribute("value"))
        if abs(shown - target) < 1e-9:
            return
        thumb = el.find_element(By.XPATH, "../..")
        d.execute_script("arguments[0].scrollIntoView({block: 'center'});", thumb)
        ActionChains(d).click(thumb).send_keys(Keys.ARROW_RIGHT if shown < target else Keys.ARROW_LEFT).perform()
        try:
            wait(lambda: float(by_label(d, label).get_attribute("value")) != shown, timeout=10 * SLOW,
                 what=f"'{label}' to move from {shown}")
        except AssertionError:
            pass  # (the key was lost: send it again)
    raise AssertionError(f"'{label}' did not reach {target}")


def click_text(d, text: str, tag: str = "*") -> None:
    el = wait(lambda: [e for e in d.find_elements(By.XPATH, f"//{tag}[normalize-space(.)='{text}']") if e.is_displayed()],
              what=f"'{text}'")[0]
    d.execute_script("arguments[0].scrollIntoView({block: 'center'});", el)
    el.click()


def button(d, text: str):
    def find():
        return [b for b in d.find_elements(By.TAG_NAME, "button") if text in b.text and b.is_displayed()]
    return wait(find, what=f"button '{text}'")[0]


def heatmap_z(d):
    return d.execute_script("""
        for (const el of document.querySelectorAll('.js-plotly-plot')) {
            for (const t of (el.data || [])) if (t.type === 'heatmap') return JSON.stringify(t.z);
        }
        return null;""")


def goto(d, title: str) -> None:
    """Use the sidebar navigation (keeps the session)."""
    link = wait(lambda: [a for a in d.find_elements(By.CSS_SELECTOR, '[data-testid="stSidebarNav"] a')
                         if a.text.strip().endswith(title)], what=f"nav link {title}")[0]
    link.click()
    wait(lambda: d.find_element(By.TAG_NAME, "h1").text.endswith(title) or title in d.find_element(By.TAG_NAME, "h1").text,
         what=f"page {title}")


def shot(d, name: str, plots: int = 0) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    wait(lambda: len([p for p in d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot") if p.is_displayed()]) >= plots,
         what=f"{plots} charts")
    time.sleep(0.8)  # let plotly finish drawing
    d.save_screenshot(str(SHOTS / f"{name}.png"))


def open_expander(d, text: str) -> None:
    summary = wait(lambda: d.find_element(By.XPATH, f"//summary[contains(., '{text}')]"), what=f"expander {text}")
    if summary.find_element(By.XPATH, "..").get_attribute("open") is None:
        d.execute_script("arguments[0].scrollIntoView({block: 'center'});", summary)
        summary.click()
        wait(lambda: summary.find_element(By.XPATH, "..").get_attribute("open") is not None, what=f"{text} open")


def close_expander(d, text: str) -> None:
    summary = d.find_element(By.XPATH, f"//summary[contains(., '{text}')]")
    if summary.find_element(By.XPATH, "..").get_attribute("open") is not None:
        summary.click()


def show_status(d) -> None:
    """Scroll the run's status line to the top of the view."""
    h = wait(lambda: [e for e in d.find_elements(By.TAG_NAME, "h3") if e.text.strip()], what="status")[0]
    d.execute_script("arguments[0].scrollIntoView({block: 'start'});", h)


def remove_choice(d, text: str) -> None:
    """Take an option out of a multiselect: its chip's remove button, until the chip is gone (once the chips are
    drawn: some chip's button shows first)."""
    wait(lambda: [b for b in d.find_elements(By.CSS_SELECTOR, 'button[aria-label^="Remove "]') if b.is_displayed()],
         timeout=60 * SLOW, what="a multiselect's chips")

    def attempt():
        chips = [b for b in d.find_elements(By.CSS_SELECTOR, f'button[aria-label="Remove {text}"]') if b.is_displayed()]
        if not chips:
            return True
        d.execute_script("arguments[0].scrollIntoView({block: 'center'});", chips[0])
        chips[0].click()
        return False

    wait(attempt, timeout=60 * SLOW, what=f"'{text}' taken out")


def choose(d, label: str, option_text: str) -> None:
    """Choose an option of a select box by its label."""
    box = by_label(d, label)
    click_when_free(d, box)
    option = wait(lambda: [o for o in d.find_elements(By.CSS_SELECTOR, '[role="option"]') if option_text in o.text],
                  what=option_text)[0]
    option.click()
    wait(lambda: option_text in by_label(d, label).get_attribute("value") or option_text in page_text(d),
         what=f"{option_text} chosen")


def fill_form(d, steps: int) -> None:
    """A policy-gradient run over KV groups and channels (the form opens on the default run: the joint preset's
    one-shot init over whole layers too), its steps and small hyperparameters."""
    open_expander(d, "Run settings")
    if not REAL:
        click_text(d, "A local model folder or .gguf file", "p")
        set_input(d, "Local model path (used when 'A local model folder or .gguf file' is chosen)", TINY)
    remove_choice(d, "Whole layers")
    choose(d, "Method", "policy gradient (forward passes only)")
    set_input(d, "Steps", steps)
    open_expander(d, "Hyperparameters")
    settings = ((("Evaluation windows (0 = all)", 32), ("Init batches (metric)", 4), ("Learning rate η", 0.02),
                 ("Validate every N steps (0 = off)", 5)) if REAL else
                (("Evaluation windows (0 = all)", 4), ("Init batches (metric)", 2),
                 ("Calibration batch size", 2), ("Calibration segment length", 64),
                 ("Evaluation window length", 64), ("Learning rate η", 0.02)))
    for label, value in settings:
        set_input(d, label, value)


def planned_removal(d, steps: int) -> tuple[int, int] | None:
    """(parameters, tolerance) the plan panel says the run will remove, once it shows the given steps."""
    import re

    if by_label(d, "Steps").get_attribute("value") != str(steps):
        return None
    m = re.search(r"Will remove ([\d,]+) parameters([^\n]*)", page_text(d))
    if not m:
        return None
    more = re.search(r"up to ([\d,]+) more", m.group(2))  # (the sentence's tolerance; none when the plan is exact)
    return int(m.group(1).replace(",", "")), int(more.group(1).replace(",", "")) if more else 0


def newest_run(runs: Path) -> Path:
    return max((p for p in runs.iterdir() if (p / "config.json").exists()), key=lambda p: (p / "config.json").stat().st_mtime)


def pick_run(d, name: str) -> None:
    """Choose a run in the Runs page's select box."""
    box = by_label(d, "Run")
    click_when_free(d, box)
    option = wait(lambda: [o for o in d.find_elements(By.CSS_SELECTOR, '[role="option"]') if name in o.text], what=name)[0]
    option.click()
    wait(lambda: name in by_label(d, "Run").get_attribute("value"), what=f"{name} chosen")


def removed_heatmap_rows(d):
    return d.execute_script("""
        for (const el of document.querySelectorAll('.js-plotly-plot')) {
            for (const t of (el.data || [])) if (t.name === 'removed layers')
                return t.z.map((row, i) => row[0] === 1 ? i : -1).filter(i => i >= 0);
        }
        return null;""")


def status_line(d) -> str:
    return " ".join(h.text for h in d.find_elements(By.TAG_NAME, "h3"))


def download(d, label: str, timeout: float = 120) -> Path:
    """Click a download button (its label starts with `label`) and wait for the browser to save the file."""
    before = set(DOWNLOADS.iterdir())
    click_when_free(d, button(d, label))
    return wait(lambda: next((p for p in set(DOWNLOADS.iterdir()) - before if not p.name.endswith(".crdownload")
                              and p.stat().st_size > 0), None), timeout=timeout * SLOW, what=f"the download of {label}")


def table_columns(d) -> list[list[str]]:
    """The columns each table (st.dataframe) draws in the window now: its grid only lays out the visible ones
    (read from the grid's accessibility table)."""
    return d.execute_script("""
        return Array.from(document.querySelectorAll('[data-testid="stDataFrame"]')).map(t =>
            Array.from(t.querySelectorAll('table th, [role=columnheader]')).map(e => e.textContent.trim()));""")


KEY_COLUMNS = ("run", "scope", "rate", "removed", "ppl pruned", "speed-up")  # what a 1400 px window must show of a run


def heatmap_reading(d) -> dict | None:
    """The KV-group heatmap as the page draws it now, read from its Plotly figure in one go with the page's text:
    the heatmap's z and its per-cell marks (text), the "marks" text trace that draws them (x, y, text, colour)."""
    found = d.execute_script("""
        for (const el of document.querySelectorAll('.js-plotly-plot')) {
            const data = el.data || [];
            const heat = data.find(t => t.type === 'heatmap' && t.name !== 'removed layers');
            if (!heat || !heat.text) continue;
            const m = data.find(t => t.name === 'marks');
            return JSON.stringify({z: heat.z, text: heat.text, x: heat.x, y: heat.y, page: document.body.innerText,
                                   marks: m ? {x: m.x, y: m.y, text: m.text, colour: m.textfont.color} : null});
        }
        return null;""")
    return json.loads(found) if found else None


def marks_of(reading: dict) -> list[list[int]]:
    """The ✓/✗ of each cell, as 0/1, from the heatmap's data; checked against the marks trace drawn on it."""
    cells = [[{"✓": 1, "✗": 0, "": 0}[t] for t in row] for row in reading["text"]]
    m = reading["marks"]
    drawn = {(y, x): t for x, y, t in zip(m["x"], m["y"], m["text"])}
    assert drawn == {(reading["y"][i], reading["x"][j]): t for i, row in enumerate(reading["text"])
                     for j, t in enumerate(row) if t}
    return cells


def saved_head_mask(run: Path, prefix: str = "masks") -> list[list[int]]:
    """masks.safetensors' KV-group mask (final, or init_masks), per layer."""
    from safetensors.torch import load_file

    sizes = json.loads((run / "masks.json").read_text())["units_per_layer"]["kv_groups"]
    flat = load_file(str(run / "masks.safetensors"))[f"{prefix}.kv_groups"].tolist()
    return [[int(x > 0.5) for x in flat[sum(sizes[:i]):sum(sizes[:i + 1])]] for i in range(len(sizes))]


def shown_step_masks(d, run: Path) -> tuple[int, list[list[int]], list[list[int]]]:
    """(step, marks, that step's masks in metrics.jsonl) of the current mask the page shows; read twice alike, so
    that a redraw between the toggle's label and the figure is not taken for the page's state."""
    import re

    from engine.run.state import report_masks

    def read():
        r = heatmap_reading(d)
        m = re.search(r"current \(step (\d+)\)", r["page"]) if r else None
        return (int(m.group(1)), marks_of(r), r) if m else None

    def stable():
        a = read()
        time.sleep(0.2)
        b = read()
        return a if a and b and a[:2] == b[:2] else None

    step, marks, reading = wait(stable, timeout=60 * SLOW, what="the current mask")
    lines = {r["step"]: r for r in (json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip())}
    check_contrast(reading)
    return step, marks, report_masks(lines[step])["kv_groups"]


def check_contrast(reading: dict) -> None:
    """Every mark's colour on its cell's colour: at least WCAG AA's 4.5:1."""
    from engine.ui.figures import cell_colours, contrast_ratio

    cells = cell_colours(reading["z"])
    where = {(y, x): c for x, y, c in zip(reading["marks"]["x"], reading["marks"]["y"], reading["marks"]["colour"])}
    for i, row in enumerate(cells):
        for j, colour in enumerate(row):
            if (reading["y"][i], reading["x"][j]) in where:
                assert contrast_ratio(colour, where[(reading["y"][i], reading["x"][j])]) >= 4.5


# --- the test ---------------------------------------------------------------------------------
def test_browser_end_to_end(server, browser):
    url, runs = server
    d = browser
    t0 = time.time()
    d.get(url)
    wait(lambda: "Prune" in d.find_element(By.TAG_NAME, "h1").text, timeout=90 * SLOW, what="the Prune page")
    wait(lambda: "No run yet" in page_text(d), what="the empty run panel")  # (a fragment: drawn after the form)

    # The plan panel on first load: what the default settings will remove, and how long they will take.
    plan = wait(lambda: [e for e in d.find_elements(By.XPATH, "//*[contains(text(), 'Will remove')]") if e.is_displayed()],
                timeout=60 * SLOW, what="the plan panel")[0]
    d.execute_script("arguments[0].scrollIntoView({block: 'center'});", plan)
    shot(d, "prune-plan")

    # The rate slider: 0.30 -> 0.50 with the keyboard, on its thumb.
    rate = by_label(d, "Pruning rate")  # the range input inside the slider's thumb
    assert rate.get_attribute("value") == "0.3"
    slide_to(d, "Pruning rate", 0.5)
    assert "0.50" in d.find_element(By.CSS_SELECTOR, '[data-testid="stSliderThumbValue"]').text

    # A long run: watch the heatmap change, then stop it.
    fill_form(d, steps=5000)
    start_run(d)
    z0 = wait(lambda: heatmap_z(d), timeout=120 * SLOW, what="the KV-group heatmap")
    wait(lambda: heatmap_z(d) not in (None, z0), timeout=60 * SLOW, what="the heatmap to update")
    assert "Running" in status_line(d)
    if REAL:  # let the loss curve and a held-out check or two accumulate
        wait(lambda: "8/5000 steps" in page_text(d), timeout=60 * SLOW, what="8 steps")
    show_status(d)
    shot(d, "prune-running", plots=3)
    button(d, "Stop").click()
    wait(lambda: "Stopped" in status_line(d), timeout=60 * SLOW, what="the run to stop")
    wait(lambda: "Resume" in page_text(d), timeout=30 * SLOW, what="the Resume button")  # (it may draw after the status)

    # A short run to the end.
    open_expander(d, "Run settings")
    set_input(d, "Steps", 20 if REAL else 8)
    planned = wait(lambda: planned_removal(d, 20 if REAL else 8), what="the plan of the short run")
    button(d, "Start pruning").click()
    wait(lambda: "Done" in status_line(d) and "Pruned perplexity" in page_text(d), timeout=120 * SLOW,
         what="the short run to finish")
    show_status(d)
    shot(d, "prune-done", plots=3)
    short_run = newest_run(runs)
    removed = json.loads((short_run / "results.json").read_text())["params_removed"]
    assert abs(removed - planned[0]) <= max(planned[1], 1), (removed, planned)  # the plan said so, within one unit

    # Deploy from the finished run: the sliced model as a zip that transformers loads, and a GGUF made on demand.
    import zipfile

    zipped = download(d, "Sliced model (zip)")
    assert zipped.name == f"{short_run.name}-model.zip"
    with zipfile.ZipFile(zipped) as z:
        z.extractall(DOWNLOADS / "unzipped")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DOWNLOADS / "unzipped" / zipped.stem), trust_remote_code=True)
    assert model.config.vocab_size > 0
    if importlib.util.find_spec("llama_cpp") is not None:
        click_when_free(d, button(d, "Make the GGUF (f16)"))
        gguf_file = download(d, "GGUF f16 (", timeout=180)
        assert gguf_file.name == f"{short_run.name}-f16.gguf"
        from engine.tools import llamacpp

        llamacpp.close(llamacpp.open_gguf(gguf_file, n_ctx=64))  # llama.cpp loads it

    # A narrow window still reads.
    d.set_window_size(480, HEIGHT)
    time.sleep(1.5)
    show_status(d)
    shot(d, "prune-narrow")
    d.set_window_size(WIDTH, HEIGHT)

    # Compare: start the matching uniform run, wait for it, compare.
    goto(d, "Compare")
    if not REAL:  # the settings survive a visit to another page
        goto(d, "Prune")
        open_expander(d, "Run settings")
        assert by_label(d, "Local model path (used when 'A local model folder or .gguf file' is chosen)") \
            .get_attribute("value") == str(TINY)
        assert by_label(d, "Steps").get_attribute("value") == "8"
        goto(d, "Compare")
    button(d, "Start the matching uniform run").click()
    wait(lambda: "Started" in page_text(d), what="the uniform run to start")
    goto(d, "Prune")
    wait(lambda: "Done" in status_line(d) and "uniform" in page_text(d), timeout=120 * SLOW, what="the uniform run")
    goto(d, "Compare")
    wait(lambda: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) >= 2, what="the comparison charts")
    text = page_text(d)
    assert "global" in text and "uniform" in text
    shot(d, "compare", plots=2)

    # Chat: both models answer.
    goto(d, "Chat")
    box = wait(lambda: d.find_element(By.CSS_SELECTOR, '[data-testid="stChatInputTextArea"]'), what="the chat input")
    box.send_keys("What is the capital of France?" if REAL else "Once upon a time, there was a")
    box.send_keys(Keys.ENTER)
    captions = wait(lambda: (c := [e.text for e in d.find_elements(By.CSS_SELECTOR, '[data-testid="stCaptionContainer"]')
                                   if "tokens/s" in e.text]) and len(c) == 2 and c, timeout=90 * SLOW, what="two answers")
    assert all(int(c.split(" tokens")[0]) > 0 for c in captions)
    answers = [e.text for e in d.find_elements(By.CSS_SELECTOR, '[data-testid="stColumn"] [data-testid="stMarkdownContainer"]')
               if e.text and not e.text.startswith(("Dense", "Pruned")) and "tokens/s" not in e.text]
    assert len(answers) >= 2 and all(a.strip() for a in answers[:2]), answers
    shot(d, "chat")

    # Chat with the run's GGUF in llama.cpp (exported on first use): a second answer pair under the first.
    if importlib.util.find_spec("llama_cpp") is not None:
        click_text(d, "GGUF in llama.cpp (the deployable file)", "p")
        box = wait(lambda: d.find_element(By.CSS_SELECTOR, '[data-testid="stChatInputTextArea"]'), what="the chat input")
        box.send_keys("Tell me about the sea." if REAL else "The little dog")
        box.send_keys(Keys.ENTER)
        captions = wait(lambda: (c := [e.text for e in d.find_elements(By.CSS_SELECTOR, '[data-testid="stCaptionContainer"]')
                                       if "tokens/s" in e.text]) and len(c) == 4
                                      and all("llama.cpp" in x for x in c[2:]) and c, timeout=120 * SLOW,
                        what="the llama.cpp answer")  # (a redraw once showed the first pair twice: 4 captions)
        assert all(int(c.split(" tokens")[0]) > 0 for c in captions)
        assert "GGUF" in page_text(d)
        # the dense side runs in llama.cpp too (the dense model's GGUF of the same type), and the speed-up is theirs
        assert all("tokens/s in llama.cpp f16" in c for c in captions[2:]), captions
        assert "Speed-up, same backend (llama.cpp f16)" in page_text(d)
        shot(d, "chat-gguf")

    # Runs: the three runs are listed.
    goto(d, "Runs")
    wait(lambda: "Delete run" in page_text(d), what="the runs page")
    shot(d, "runs")
    assert len([p for p in runs.iterdir() if (p / "config.json").exists()]) == 3
    assert button(d, "Sliced model (zip)")  # the downloads are on Runs too

    # At 1400 px the key columns of the Runs table and of Compare's are in view.
    d.set_window_size(1400, HEIGHT)
    time.sleep(1.5)
    assert all(c in wait(lambda: table_columns(d)[0], what="the runs table") for c in KEY_COLUMNS), table_columns(d)
    shot(d, "runs-1400")
    goto(d, "Compare")
    assert all(c in wait(lambda: table_columns(d)[0], what="the comparison table") for c in KEY_COLUMNS), \
        table_columns(d)
    shot(d, "compare-1400", plots=2)
    # At 1000 px the Runs table starts with the run's name (issue 66: two runs of one setting read apart).
    d.set_window_size(1000, HEIGHT)
    goto(d, "Runs")
    time.sleep(1.5)
    first = wait(lambda: [c for c in table_columns(d)[0] if c][:1], what="the runs table at 1000 px")
    assert first == ["run"], table_columns(d)
    shot(d, "runs-1000")
    d.set_window_size(WIDTH, HEIGHT)
    goto(d, "Runs")

    # Re-run the short run with its settings: the new run's config is the same.
    if not REAL:
        pick_run(d, short_run.name)
        button(d, "Re-run").click()
        wait(lambda: d.find_element(By.TAG_NAME, "h1").text.endswith("Prune"), what="the Prune page")
        open_expander(d, "Run settings")
        wait(lambda: "Settings from run" in page_text(d) and short_run.name in page_text(d), what="the run's settings")
        before = set(runs.iterdir())
        button(d, "Start pruning").click()
        again = wait(lambda: next((p for p in set(runs.iterdir()) - before if (p / "results.json").exists()), None),
                     timeout=120, what="the re-run to finish")
        assert json.loads((again / "config.json").read_text()) == json.loads((short_run / "config.json").read_text())

    # Compare two runs that prune whole layers (it once crashed on them), which removed different parameters.
    if not REAL:
        layer_runs(runs)
        d.get(f"{url}/compare?runs=zz-layers,zz-layers-width")  # a link picks the runs (a new session)
        wait(lambda: "removed different numbers of parameters" in page_text(d), what="the parameter warning")
        assert "Steps: A 2, B 3" in page_text(d)  # the runs' differing settings, named
        text = page_text(d)
        assert "Traceback" not in text and "Error" not in text.split("Compare", 1)[-1][:50]
        # the picked runs, A first, as the page's header line names them
        assert "A zz-layers: global" in text and "B zz-layers-width: uniform" in text, text[:600]
        shot(d, "compare-layers", plots=2)

        # A run that removed a layer: that layer is grey and marked removed in the KV-group heatmap.
        goto(d, "Runs")
        pick_run(d, "zz-layers-width")
        button(d, "Load into the pages").click()
        # the click's rerun must land before the page changes: a navigation sent while it runs can replace it
        wait(lambda: "Loaded zz-layers-width" in page_text(d), what="the load's confirmation")
        goto(d, "Prune")
        kept = json.loads((runs / "zz-layers-width" / "results.json").read_text())["kept_per_layer"]["layers"]
        removed_rows = wait(lambda: removed_heatmap_rows(d), what="the removed layers in the heatmap")
        assert removed_rows == [i for i, k in enumerate(kept) if not k] and removed_rows
        shot(d, "prune-removed-layer", plots=2)
        # A reload (a new session) keeps the loaded run: its name is in the URL (?run=NAME).
        assert "run=zz-layers-width" in d.current_url, d.current_url
        d.refresh()
        wait(lambda: "Run zz-layers-width" in page_text(d), what="the loaded run after a reload")
    print(f"browser test took {time.time() - t0:.0f} s")


def layer_runs(runs: Path) -> None:
    """Two finished runs on the tiny model that prune whole layers: layers alone (global) and layers with
    widths (uniform, each type losing half its count), so they remove different numbers of parameters."""
    from engine.settings.config import FAST, PruneConfig
    from engine.run.loop import PruneRun

    calib = str(ROOT.parent / "shared" / "data" / "c4" / "c4-en.llamafactory-c4_demo.300.text-only.json.gz")
    small = dict(steps=2, max_windows=2, init_batches=1, layer_init_batches=1, batch_size=2, seqlen=32, eval_seqlen=32,
                 num_mask_samples=2, val_batches=1, calib=calib, budget="units", prune_ratio=0.5)
    for name, units, scope, steps in (("zz-layers", ["layers"], "global", 2),
                                      ("zz-layers-width", ["kv_groups", "channels", "layers"], "uniform", 3)):
        PruneRun(PruneConfig(**{**FAST, **small, "steps": steps, "units": units}, model=str(TINY), scope=scope), runs / name,
                 log=lambda m: None).run(progress=False)
        time.sleep(1.1)  # newest last: Compare's defaults pick the newest global run, and the newest uniform one
