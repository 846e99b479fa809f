"""Security and writes (issue 48): the app listens on this machine only and keeps typed paths in its folders; no
checkpoint.pt or model folder runs code; nothing is written through a symbolic link in a run folder, nor deleted by a
resume or an overwrite; torchrun's ranks agree on the data they read. Each test failed before that change."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.cli import main
from engine.settings.config import PruneConfig
from engine.errors import UserError
from engine.run.loop import PruneRun

from conftest import (REPO, SMALL_CALIB, TINY_MODEL, WIKI_RAW, calib_data_dir, clean_env, engine_in_process, one_error,
                      process_alive, quiet, tiny_config)


@pytest.fixture
def stopped_run(tiny, eval_file, tmp_path) -> Path:
    """A 3-step run of the tiny model stopped after its first step (checkpoint and metrics line of step 1)."""
    import threading

    out, stop = tmp_path / "run", threading.Event()
    result = PruneRun(tiny_config(eval_file), out, model=tiny[0], tokenizer=tiny[1], log=quiet).run(
        observer=lambda report: stop.set(), stop=stop, progress=False)
    assert result["status"] == "stopped" and (out / "checkpoint.pt").is_file()
    return out


@pytest.fixture
def finished_run(tiny, eval_file, tmp_path) -> Path:
    out = tmp_path / "done"
    PruneRun(tiny_config(eval_file), out, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    return out


# --- (a) the app listens on this machine only -------------------------------------------------------------------
def _listening(port: int) -> list[str]:
    """The local addresses listening on `port` (/proc/net/tcp and tcp6: state 0A), as hex as the kernel writes them."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            local, state = ln.split()[1], ln.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1, in /proc/net's byte order


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_the_app_listens_on_127_0_0_1_only(tmp_path, where):
    """`streamlit run app.py` with the repository's .streamlit/config.toml: reachable on 127.0.0.1, and listening on
    no other address (before: *:8501, every interface). "elsewhere": `streamlit run /path/to/app.py` started from
    another folder (streamlit reads the config beside the script too)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script, cwd = ("app.py", REPO) if where == "repo" else (str(REPO / "app.py"), tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", script, "--server.port", str(port),
                             "--server.headless", "true"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=clean_env(PG_PRUNE_RUNS_DIR=str(tmp_path / "runs")), text=True)
    try:
        deadline, connected = time.monotonic() + 180, False  # (a busy machine: streamlit's imports take a while)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                connected = True
                break
            except OSError:
                time.sleep(0.2)
        assert connected, "the app never answered on 127.0.0.1"
        addresses = _listening(port)
        assert addresses and set(addresses) <= LOOPBACK, addresses
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "Network URL" not in out, out


def test_app_paths_stay_in_the_runs_folder_or_the_configured_ones(tmp_path, monkeypatch, finished_run):
    """The Runs page's "Copy the sliced model to a new folder" (export_run_model) and the model field (form_config)
    refuse a path outside the runs folder and $PG_PRUNE_APP_FOLDERS, in one line; inside them they work."""
    from engine.ui import settings as S
    from engine.ui.jobs import export_run_model

    runs, allowed, outside = tmp_path / "runs", tmp_path / "allowed", tmp_path / "elsewhere"
    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(runs))
    monkeypatch.setenv("PG_PRUNE_APP_FOLDERS", str(allowed))
    with pytest.raises(UserError, match="outside the folders this app may use") as e:
        export_run_model(finished_run, outside / "copy")
    assert "\n" not in str(e.value) and not outside.exists()
    (outside / "sub").mkdir(parents=True)
    (allowed / "link").parent.mkdir()
    (allowed / "link").symlink_to(outside / "sub")  # a link out of an allowed folder leads outside it
    with pytest.raises(UserError, match="outside"):
        export_run_model(finished_run, allowed / "link" / "copy")
    with pytest.raises(UserError, match="outside"):
        export_run_model(finished_run, runs / ".." / "elsewhere" / "copy2")
    assert not (outside / "sub" / "copy").exists() and not (outside / "copy2").exists()
    assert (export_run_model(finished_run, allowed / "copy") / "config.json").is_file()
    runs.mkdir()
    assert (export_run_model(finished_run, runs / "copy") / "config.json").is_file()
    values = {**S.default_values(), "model_choice": "local"}
    with pytest.raises(UserError, match="the model path .* is outside"):
        S.form_config({**values, "model_path": str(TINY_MODEL)})
    monkeypatch.setenv("PG_PRUNE_APP_FOLDERS", os.pathsep.join([str(allowed), str(TINY_MODEL.parent)]))
    assert S.form_config({**values, "model_path": str(TINY_MODEL)}).model == str(TINY_MODEL)


# --- (b) no checkpoint.pt runs code ----------------------------------------------------------------------------
class _CreatesAFile:
    """Unpickling this calls open(path, "w"): a stand-in for any code a crafted checkpoint.pt would run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class _TouchesAFile(_CreatesAFile):
    """Unpickling this runs a shell command (os.system("touch PATH"))."""

    def __reduce__(self):
        return os.system, (f"touch '{self.path}'",)


PAYLOADS = {"open": (_CreatesAFile, "io.open"), "os.system": (_TouchesAFile, "posix.system")}


def _craft_checkpoint(run: Path, target: Path, payload=_CreatesAFile) -> None:
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["method_state"] = {"control_moments": payload(target)}
    torch.save(state, run / "checkpoint.pt")


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_a_crafted_checkpoint_runs_nothing_on_resume_from_the_cli(stopped_run, tmp_path, capfd, payload):
    target = tmp_path / "created-by-the-checkpoint"
    cls, named = PAYLOADS[payload]
    _craft_checkpoint(stopped_run, target, cls)
    capfd.readouterr()
    assert main(["prune", "--out", str(stopped_run), "--resume"]) == 2
    one_error(capfd, "refusing checkpoint", named)
    assert not target.exists()


def test_a_crafted_metric_cache_entry_runs_nothing(tmp_path, monkeypatch):
    """An entry of $PG_PRUNE_METRIC_CACHE (or of a run folder's init_progress/, read the same way) that would run code
    when unpickled: refused in one line, nothing created (before: torch's UnpicklingError, a traceback)."""
    from types import SimpleNamespace

    from engine.model.arch import ModelAdapter
    from engine.model.distributed import World
    from engine.run.initialise import cached_metric
    from engine.algo.metrics import MetricContext
    from engine.model.unit_types import unit_sizes
    from test_methods import _Layout, build_model

    cache = tmp_path / "cache"
    monkeypatch.setenv("PG_PRUNE_METRIC_CACHE", str(cache))
    a = ModelAdapter.for_model(build_model("llama"))
    batches = [torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    run = SimpleNamespace(world=World(), source=SimpleNamespace(path="m", gguf_file=None),
                          config=SimpleNamespace(dtype="float32", pass_dtype="float32", device="cpu"), model=None,
                          log=lambda line: None)
    ctx = lambda: MetricContext(a, _Layout(unit_sizes(a)), batches, keep_ratio=0.67)  # noqa: E731
    cached_metric(run, "sleb", ["layers"], ctx())
    (entry,) = cache.iterdir()
    target = tmp_path / "created-by-the-cache"
    torch.save({"order": _CreatesAFile(target)}, entry)
    with pytest.raises(UserError, match="refusing cached metric entry .*io.open") as e:
        cached_metric(run, "sleb", ["layers"], ctx())
    assert "\n" not in str(e.value) and not target.exists()


def test_a_crafted_checkpoint_runs_nothing_on_the_apps_resume(stopped_run, tmp_path, monkeypatch):
    """The app's "Resume this run": JobManager.start(None, RUN, resume=True), as pages/prune.py calls it."""
    from engine.ui.jobs import FAILED, JobManager

    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(stopped_run.parent))
    target = tmp_path / "created-by-the-checkpoint"
    _craft_checkpoint(stopped_run, target)
    jobs = JobManager()
    jobs.start(None, stopped_run, resume=True)
    snap = jobs.wait(timeout=300)
    assert snap.status == FAILED and "refusing checkpoint" in snap.error and "\n" not in snap.error, snap.error
    assert not target.exists()


def test_checkpoints_written_today_load_through_the_safe_path(stopped_run, capfd):
    """The weights-only reader takes every checkpoint a run writes (and an older one is the same format)."""
    from engine.run.checkpoints import read_checkpoint

    assert read_checkpoint(stopped_run / "checkpoint.pt")["step"] == 1
    assert main(["prune", "--out", str(stopped_run), "--resume"]) == 0
    assert json.loads((stopped_run / "results.json").read_text())["steps"] == 3


def _custom_code(folder: Path, marker: Path, base: Path = TINY_MODEL) -> Path:
    """`folder` as a copy of the model `base` whose config.json names an unknown model_type and an auto_map: code of
    its own (custom.py), which creates `marker` when it is imported."""
    folder.mkdir(exist_ok=True)
    for f in base.iterdir():
        if f.name != "config.json" and f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((base / "config.json").read_text())
    config.update(model_type="pg-prune-test-custom", auto_map={"AutoConfig": "custom.Config",
                                                               "AutoModelForCausalLM": "custom.Model",
                                                               "AutoTokenizer": ["custom.Tokenizer", None]})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return folder


def test_a_model_folder_that_needs_its_own_code_is_refused_without_a_prompt(tmp_path):
    """An unknown model_type with an auto_map: `eval` says so in one line, with a terminal-like stdin attached (a pipe
    that would answer "y"), and runs nothing (transformers would ask "Do you wish to run the custom code? [y/N]")."""
    marker = tmp_path / "the-folder's-code-ran"
    folder = _custom_code(tmp_path / "custom", marker)
    r = subprocess.run([sys.executable, "-m", "engine", "eval", "--model", str(folder), "--eval-data", str(WIKI_RAW),
                        "--max-windows", "1", "--eval-seqlen", "32"], cwd=REPO, env=clean_env(), input="y\ny\n",
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr[-2000:]
    assert "its own Python code" in lines[0] and "[y/N]" not in r.stdout + r.stderr and not marker.exists()


@pytest.fixture
def answers_yes(monkeypatch):
    """stdin answers "y" to any question (transformers' "Do you wish to run the custom code? [y/N]" would run it)."""
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))


@pytest.mark.parametrize("command", ["prune", "eval", "zeroshot"])
def test_every_command_refuses_a_model_folder_with_its_own_code(command, tmp_path, eval_file, capfd, answers_yes):
    """prune, eval and zeroshot --model FOLDER (unknown model_type, auto_map): one error line, nothing asked, the
    folder's code never imported (the marker it would create is absent)."""
    marker = tmp_path / "the-folder's-code-ran"
    folder = str(_custom_code(tmp_path / "custom", marker))
    argv = {"prune": ["prune", "--model", folder, "--steps", "1", "--batch-size", "2", "--seqlen", "32",
                      "--eval-seqlen", "32", "--max-windows", "2", "--init-batches", "1", "--calib", str(SMALL_CALIB),
                      "--eval-data", str(eval_file), "--out", str(tmp_path / "run")],
            "eval": ["eval", "--model", folder, "--eval-data", str(eval_file), "--max-windows", "1",
                     "--eval-seqlen", "32"],
            "zeroshot": ["zeroshot", "--model", folder, "--tasks", "boolq", "--limit", "1",
                         "--out", str(tmp_path / "zs")]}[command]
    capfd.readouterr()
    assert main(argv) == 2
    captured = capfd.readouterr()
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "its own Python code" in errors[0], captured.err[-2000:]
    assert "[y/N]" not in captured.out + captured.err and not marker.exists()


def test_a_run_whose_model_needs_its_own_code_is_refused_by_export_and_chat(finished_run, tmp_path, capfd, answers_yes):
    """A run folder (from elsewhere) whose model/ config.json names its own code: `export --format gguf` and the app's
    Chat page (load_sliced, the sliced export) refuse it in one line and never import it (before: the Chat page
    raised transformers' several-line ValueError)."""
    from engine.tools.chat import load_sliced

    marker = tmp_path / "the-folder's-code-ran"
    _custom_code(finished_run / "model", marker, base=finished_run / "model")
    capfd.readouterr()
    assert main(["export", str(finished_run), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    one_error(capfd, "its own Python code")
    with pytest.raises(UserError, match="its own Python code") as e:
        load_sliced(finished_run)
    assert "\n" not in str(e.value) and not marker.exists() and not (tmp_path / "m.gguf").exists()


def test_the_app_refuses_a_model_folder_with_its_own_code(tmp_path, monkeypatch, answers_yes):
    """The app's Prune page (its plan: model_skeleton) and its job (JobManager.start of a config naming the folder):
    one line each, the folder's code never imported."""
    from engine.plan.forecast import model_skeleton
    from engine.ui.jobs import FAILED, JobManager

    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(tmp_path / "runs"))
    marker = tmp_path / "the-folder's-code-ran"
    folder = str(_custom_code(tmp_path / "custom", marker))
    with pytest.raises(UserError, match="its own Python code") as e:
        model_skeleton(folder)
    assert "\n" not in str(e.value)
    jobs = JobManager()
    try:
        jobs.start(PruneConfig(model=folder, steps=1, calib=str(SMALL_CALIB)), tmp_path / "runs" / "r")
        snap = jobs.wait(timeout=300)
        assert snap.status == FAILED and "its own Python code" in snap.error and "\n" not in snap.error, snap.error
    except UserError as refused:  # (refused before the job starts: as good)
        assert "its own Python code" in str(refused) and "\n" not in str(refused)
    assert not marker.exists()


# --- (c) no write through a symbolic link, no deletion on resume -----------------------------------------------
@pytest.mark.parametrize("links", [(".pg-prune.lock",), (".pg-prune.lock", "metrics.jsonl"), ("metrics.jsonl",),
                                   ("init_progress",)])
def test_resume_writes_nothing_through_symlinks(stopped_run, tmp_path, capfd, links):
    """A run folder unpacked from elsewhere whose lock, metrics.jsonl (or init_progress/) is a link to a user's file
    (or folder): --resume refuses in one line naming the link, and the user's files are byte for byte as they were."""
    user = tmp_path / "user"
    user.mkdir()
    before = {}
    for name in links:
        target = user / f"notes-{name.strip('.')}"
        if name == "init_progress":
            target.mkdir()
            (target / "keep.txt").write_text("mine\n")
        else:
            target.write_bytes(b"the user's own file\n" * 3)
        (stopped_run / name).unlink(missing_ok=True)
        (stopped_run / name).symlink_to(target)
    before = {str(p): p.read_bytes() for p in user.rglob("*") if p.is_file()}
    capfd.readouterr()
    assert main(["prune", "--out", str(stopped_run), "--resume"]) == 2
    one_error(capfd, "symbolic link", links[0])
    assert {str(p): p.read_bytes() for p in user.rglob("*") if p.is_file()} == before
    assert all((stopped_run / name).is_symlink() for name in links)  # (not followed, not removed)


def test_the_lock_is_never_written_through_a_link(tmp_path):
    from engine.storage.outdir import LOCK_FILE, folder_lock

    user = tmp_path / "user.txt"
    user.write_text("mine\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / LOCK_FILE).symlink_to(user)
    for exclusive in (True, False):
        with pytest.raises(UserError, match="symbolic link"):
            with folder_lock(tmp_path / "out", exclusive=exclusive):
                pass
    assert user.read_text() == "mine\n"


def test_resume_keeps_the_users_files_in_model(finished_run, capfd):
    """--resume --steps N of a finished run re-exports model/: a model/ holding the user's notes and a sub-folder is
    refused as --overwrite refuses it, and nothing is deleted."""
    (finished_run / "model" / "notes.txt").write_text("mine\n")
    (finished_run / "model" / "sub").mkdir()
    (finished_run / "model" / "sub" / "x.bin").write_bytes(b"1")
    capfd.readouterr()
    assert main(["prune", "--out", str(finished_run), "--resume", "--steps", "4"]) == 2
    one_error(capfd, "--resume refused", "notes.txt")
    assert (finished_run / "model" / "notes.txt").read_text() == "mine\n" and (finished_run / "model" / "sub" / "x.bin").is_file()


def test_no_run_starts_inside_another_runs_folder(finished_run, eval_file, capfd, tiny_path):
    inner = finished_run / "model" / "inner"
    flags = ["--model", str(tiny_path), "--steps", "1", "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "32",
             "--max-windows", "2", "--init-batches", "1", "--calib", str(SMALL_CALIB), "--eval-data", str(eval_file)]
    capfd.readouterr()
    assert main(["prune", *flags, "--out", str(inner)]) == 2
    one_error(capfd, "inside the run folder", str(finished_run))
    assert not inner.exists()
    assert main(["prune", *flags, "--out", str(finished_run / "nested")]) == 2
    one_error(capfd, "inside the run folder")


def test_an_export_into_a_runs_own_names_is_refused(finished_run, tmp_path, capfd):
    """`export RUN --format gguf --out RUN/model.gguf` would be deleted by a later `prune --out RUN --overwrite`: it is
    refused; an export beside the run under another name survives the overwrite."""
    capfd.readouterr()
    assert main(["export", str(finished_run), "--format", "gguf", "--out", str(finished_run / "model.gguf")]) == 2
    one_error(capfd, "model.gguf belongs to the run around it")
    assert not (finished_run / "model.gguf").exists()
    assert main(["export", str(finished_run), "--format", "hf", "--out", str(finished_run / "model" / "copy")]) == 2
    one_error(capfd, "the run's own model folder")
    mine = finished_run / "mine"
    assert main(["export", str(finished_run), "--format", "hf", "--out", str(mine)]) == 0
    config = json.loads((finished_run / "config.json").read_text())
    argv = ["prune", "--out", str(finished_run), "--overwrite", "--model", config["model"], "--steps", "1",
            "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "32", "--max-windows", "2", "--init-batches", "1",
            "--calib", config["calib"], "--eval-data", config["eval_data"]]
    assert main(argv) == 0
    assert (mine / "config.json").is_file()


def test_a_bare_resume_of_a_finished_run_says_it_is_finished(finished_run, capfd):
    model = {p.name: p.stat().st_mtime_ns for p in (finished_run / "model").iterdir()}
    results = (finished_run / "results.json").read_bytes()
    capfd.readouterr()
    assert main(["prune", "--out", str(finished_run), "--resume"]) == 0
    err = capfd.readouterr().err.strip().splitlines()
    finished = [ln for ln in err if "is finished" in ln]
    assert len(finished) == 1 and "--steps" in finished[0] and not any("exporting" in ln for ln in err), err
    assert {p.name: p.stat().st_mtime_ns for p in (finished_run / "model").iterdir()} == model
    assert (finished_run / "results.json").read_bytes() == results


# --- (d) torchrun: the ranks read the same data ----------------------------------------------------------------
@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_ranks_that_read_different_calibration_data_are_refused(eval_file, tmp_path):
    """Two gloo ranks with the same command but each its own $PG_PRUNE_DATA_DIR (no --calib): refused before the first
    step, naming the calibration data and where each rank read it (before: the run went to the end silently)."""
    import gzip

    with gzip.open(SMALL_CALIB, "rt", encoding="utf-8") as fh:
        docs = [json.loads(ln)["text"] for ln in fh if ln.strip()][:60]
    dirs = [calib_data_dir(tmp_path / "data0", docs), calib_data_dir(tmp_path / "data1", docs[::-1][:50])]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    argv = ["--model", str(TINY_MODEL), "--steps", "2", "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "32",
            "--max-windows", "2", "--init-batches", "1", "--eval-data", str(eval_file), "--out", str(out)]
    ranks = [subprocess.Popen([sys.executable, "-m", "engine", "prune", *argv], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(OMP_NUM_THREADS="1", PG_PRUNE_DIST_TIMEOUT="60", MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r),
                                            LOCAL_WORLD_SIZE="2", PG_PRUNE_DATA_DIR=str(d)))
             for r, d in enumerate(dirs)]
    results = [p.communicate(timeout=300) for p in ranks]
    for p, (_, err) in zip(ranks, results):
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
        assert "different calibration data" in errors[0] and str(dirs[0]) in errors[0] and str(dirs[1]) in errors[0]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
    assert not (out / "checkpoint.pt").exists()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
@pytest.mark.skipif(not Path("/proc/1/stat").exists(), reason="needs Linux's /proc")
def test_the_ranks_end_when_torchrun_is_killed(eval_file, tmp_path):
    """While torchrun's ranks run, a one-process --resume of their folder is refused (rank 0 holds the lock). kill -9 of
    the torchrun parent: its two ranks end within seconds (before: they ran on), rank 0 saving its last step, and a
    one-process --resume then finishes the run."""
    import signal

    out = tmp_path / "run"
    argv = ["--preset", "fast", "--model", str(TINY_MODEL), "--steps", "100000", "--batch-size", "2", "--seqlen", "32", "--eval-seqlen",
            "32", "--max-windows", "2", "--init-batches", "1", "--num-mask-samples", "2", "--calib", str(SMALL_CALIB),
            "--eval-data", str(eval_file), "--checkpoint-every", "1000", "--out", str(out)]
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 "-m", "engine", "prune", *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=clean_env(OMP_NUM_THREADS="1", PG_PRUNE_DIST_TIMEOUT="60"))
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not ((out / "metrics.jsonl").is_file()
                                                   and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert launcher.poll() is None, "torchrun ended before the steps"
            time.sleep(0.5)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2, ranks
        other = engine_in_process("prune", "--out", str(out), "--resume")  # (a process other than the ranks)
        assert other.returncode == 2 and "is in use by process" in other.stderr, other.stderr[-2000:]  # (rank 0's lock)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(process_alive(p) for p in ranks):
            time.sleep(0.5)
        assert not any(process_alive(p) for p in ranks), "the ranks outlived their launcher"
    finally:
        for p in [*ranks, *(_children(launcher.pid) if launcher.poll() is None else [])]:
            if process_alive(p):
                os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
    step = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
    assert step >= 2
    r = engine_in_process("prune", "--out", str(out), "--resume", "--steps", str(step + 1))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "results.json").read_text())["steps"] == step + 1


def test_the_pages_say_in_one_line_that_a_path_is_outside(finished_run, tmp_path, monkeypatch):
    """The Runs page's export to a folder outside the runs folder and $PG_PRUNE_APP_FOLDERS, and the Prune page's
    model field pointing outside them: one error in the page each, nothing written, no exception."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(finished_run.parent))
    monkeypatch.setenv("PG_PRUNE_APP_FOLDERS", str(tmp_path / "allowed"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
    at.run()
    at.switch_page("pages/runs.py").run()
    assert not at.exception
    at.selectbox[0].select_index(next(i for i, o in enumerate(at.selectbox[0].options) if finished_run.name in o)).run()
    outside = tmp_path.parent / f"{tmp_path.name}-outside" / "copy"  # (the runs folder is tmp_path)
    outside.parent.mkdir()  # (an export there could be written)
    at.text_input[0].input(str(outside))
    next(b for b in at.button if b.label == "Export model").click().run()
    errors = [e.value for e in at.error]
    assert not at.exception and len(errors) == 1 and "outside the folders this app may use" in errors[0], errors
    assert not outside.exists() and not list(outside.parent.iterdir())

    at.switch_page("pages/prune.py").run()
    at.radio(key="model_choice").set_value("local")
    at.text_input(key="model_path").input(str(TINY_MODEL)).run()
    assert not at.exception and next(b for b in at.button if "Start pruning" in b.label).disabled  # (the plan's error)
    shown = [w.value for w in at.warning if "error:" in w.value]  # (the plan's line: "Cannot start as set — error: …")
    assert len(shown) == 1 and "the model path" in shown[0] and "outside the folders this app may use" in shown[0], shown
    assert [p.name for p in finished_run.parent.iterdir() if not p.name.startswith(".")] == [finished_run.name]


# --- the app's address, said where the user looks (issue 63) ------------------------------------------------------
def test_the_exposure_warning_is_for_addresses_beyond_this_machine():
    from engine.ui.serving import exposure_warning

    for here in ("127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost"):
        assert exposure_warning(here) is None, here
    for there in ("0.0.0.0", "::", "192.168.1.20", "myhost.example"):
        said = exposure_warning(there)
        assert said and f"listens on {there.strip('[]')}" in said and "no login" in said, there
    assert "every interface" in exposure_warning(None) and "every interface" in exposure_warning("")


def test_the_app_started_on_every_interface_warns_in_the_page_and_once_in_the_log(tmp_path, monkeypatch, capfd):
    """`streamlit run app.py --server.address 0.0.0.0`: a warning at the top of the page, on every page, saying who
    can reach it, and one `warning:` line in the server's log however often the page runs (before: nothing said in
    either; docs/app.md only). On 127.0.0.1 (the repository's config) nothing is said."""
    import streamlit.config as stconfig
    from streamlit.testing.v1 import AppTest

    from engine.ui import serving

    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(serving, "_logged", set())
    before = stconfig.get_option("server.address")
    try:
        stconfig.set_option("server.address", "0.0.0.0")
        capfd.readouterr()
        at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
        at.run()
        assert not at.exception, at.exception
        assert at.warning and "This app listens on 0.0.0.0" in at.warning[0].value, [w.value for w in at.warning]
        at.run()
        logged = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("warning: This app listens")]
        assert len(logged) == 1 and "0.0.0.0" in logged[0], logged
        stconfig.set_option("server.address", "127.0.0.1")
        at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
        at.run()
        assert not any("This app listens" in w.value for w in at.warning)
    finally:
        stconfig.set_option("server.address", before)
