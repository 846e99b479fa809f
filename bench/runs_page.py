"""The Runs page with many finished runs on disk (issue 66): the app's CPU seconds for its first render and for the
second one (a rerun, as every click makes), which reads only the runs whose files changed.

One real run on the tiny model (--steps 2) is copied N times into an empty runs folder; then the app is rendered
in this process (Streamlit's AppTest: the page's own work, without a browser) and each render's CPU seconds
(time.process_time, every thread of the process) and wall seconds are printed, and last a render with the run
summaries' cache emptied (engine/ui/jobs.py's read_run), what every render cost before it.

    python bench/runs_page.py                     # 50 runs of ../shared/models/tinystories-656k
    python bench/runs_page.py --count 10 --renders 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from cli_common import ROOT, positive, run

TINY = ROOT.parent / "shared" / "models" / "tinystories-656k"


def make_runs(runs: Path, model: str, n: int) -> None:
    """One finished run of `model` made here, then copied n - 1 times (each copy its own folder and time)."""
    from engine.cli import main as engine_main

    first = runs / "run-000"
    code = engine_main(["prune", "--model", model, "--steps", "2", "--max-windows", "4", "--init-batches", "2",
                        "--batch-size", "2", "--preset", "fast", "--out", str(first)])
    if code != 0:
        raise SystemExit(code)
    for i in range(1, n):
        dest = runs / f"run-{i:03d}"
        shutil.copytree(first, dest)
        t = time.time() - 60 * i
        os.utime(dest / "config.json", (t, t))


def render_seconds(page: str, renders: int) -> list[tuple[str, float, float]]:
    """(what, CPU seconds, wall seconds) of each render of the page, the first one included, then one more with
    the run summaries' cache emptied (what a render costs without it)."""
    from streamlit.testing.v1 import AppTest

    from engine.ui import jobs

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    jobs._READ.clear()
    out = []
    for i in range(renders + 1):
        if i == renders:
            jobs._READ.clear()
        c0, w0 = time.process_time(), time.perf_counter()
        (at.switch_page(page) if i == 0 else at).run()
        what = ("first render" if i == 0 else "second render" if i == 1 else f"render {i + 1}") if i < renders \
            else "a render with the run summaries' cache emptied"
        out.append((what, time.process_time() - c0, time.perf_counter() - w0))
        if at.exception:
            raise SystemExit(f"error: the page raised: {at.exception}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(TINY), help="the model of the run that is copied (default: the tiny one)")
    p.add_argument("--count", type=positive(int), default=50, help="finished runs on disk (default %(default)s)")
    p.add_argument("--renders", type=positive(int), default=2, help="renders of the page (default %(default)s)")
    p.add_argument("--page", default="pages/runs.py", help="the page rendered (default %(default)s)")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        runs.mkdir()
        os.environ["PG_PRUNE_RUNS_DIR"] = str(runs)
        os.environ.setdefault("PG_PRUNE_CACHE", str(Path(tmp) / "cache"))
        make_runs(runs, args.model, args.count)
        times = render_seconds(args.page, args.renders)
    threads = os.environ.get("OMP_NUM_THREADS", "torch's default")
    print(f"{args.page} with {args.count} finished runs on disk ({Path(args.model).name}; threads: {threads}):")
    for what, c, w in times:
        print(f"  {what}: {c:.3f} s of the app's CPU, {w:.3f} s wall")


if __name__ == "__main__":
    run(main)
