"""A run's folder (issue 48, run folders and resume): no write of a run goes through a symbolic link, whichever way the
run is started (the CLI, the app, the API's PruneRun); what the user put in model/ or exported beside a run is never
deleted by it, and no output starts inside a run's own files; a damaged metrics.jsonl never ends a resume in a
traceback. Each test failed on the code before its change (tests/test_security.py and tests/test_faults_truth.py hold
the CLI's cases of the same issue)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main
from engine.errors import UserError

from conftest import one_error, quiet, tiny_config

FINISHED_STEPS = 2  # (the finished run's steps: a resume to 3 continues it)


def user_files(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".pg-prune.lock"}


# --- no write through a link, however the run is started -------------------------------------------------------
def test_a_run_started_through_the_api_writes_nothing_through_a_linked_metrics_file(tiny, eval_file, tmp_path):
    """PruneRun (the API the app's jobs use) into a folder whose metrics.jsonl is a link to a user's file: refused in
    one line naming the link, the user's file byte for byte as it was (before: start_state emptied it through the
    link, write_text following it)."""
    from engine.run.loop import PruneRun

    user = tmp_path / "user" / "notes.txt"
    user.parent.mkdir()
    user.write_bytes(b"the user's own lines\n" * 4)
    before = user_files(user.parent)
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(user)
    with pytest.raises(UserError, match="metrics.jsonl.*symbolic link") as refused:
        PruneRun(tiny_config(eval_file, steps=2), out, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    assert "\n" not in str(refused.value)
    assert user_files(user.parent) == before and (out / "metrics.jsonl").is_symlink()


def test_the_first_metrics_file_replaces_a_link_never_its_target(tiny, eval_file, tmp_path, monkeypatch):
    """The write itself (not only the check before it): start_state's empty metrics.jsonl replaces a link that
    appeared there, atomically, and the linked file stays as it was."""
    from engine.run.loop import PruneRun

    user = tmp_path / "user.txt"
    user.write_text("mine\n")
    out = tmp_path / "run"

    def link_then_save(state):  # the first checkpoint's write: a link appears beside it just before
        (out / "metrics.jsonl").unlink(missing_ok=True)
        (out / "metrics.jsonl").symlink_to(user)
        return original(state)

    run = PruneRun(tiny_config(eval_file, steps=1), out, model=tiny[0], tokenizer=tiny[1], log=quiet)
    original = run.checkpoints.save
    monkeypatch.setattr(run.checkpoints, "save", link_then_save)
    run.run(progress=False)
    assert user.read_text() == "mine\n"
    assert not (out / "metrics.jsonl").is_symlink() and len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_an_api_resume_keeps_the_users_files_in_model(finished, tiny, eval_file):
    """PruneRun(...).run(resume=True) of a finished run re-exports model/: the user's notes and sub-folder there are
    refused as --overwrite refuses them, and nothing is deleted (before: the export replaced model/ with them)."""
    from engine.run.loop import PruneRun

    (finished / "model" / "notes.txt").write_text("mine\n")
    (finished / "model" / "sub").mkdir()
    (finished / "model" / "sub" / "x.bin").write_bytes(b"1")
    with pytest.raises(UserError, match=r"--resume refused: .*notes\.txt.*nothing was deleted"):
        PruneRun(tiny_config(eval_file, steps=3), finished, model=tiny[0], tokenizer=tiny[1],
                 log=quiet).run(resume=True, progress=False)
    assert (finished / "model" / "notes.txt").read_text() == "mine\n"
    assert (finished / "model" / "sub" / "x.bin").read_bytes() == b"1"


# --- what the user exports beside a run survives it ----------------------------------------------------------
@pytest.mark.parametrize("name", ["model.gguf", "init_progress", "model.f16.gguf"])
def test_the_apps_export_into_a_runs_own_names_is_refused(finished, name):
    """The Runs page's "Copy the sliced model to a new folder" into RUN/model.gguf (or another of the run's own
    names) is refused as the CLI's export is: the run's --overwrite would delete it (before: it was written)."""
    from engine.run.folder import remove_run_files
    from engine.ui.jobs import export_run_model

    with pytest.raises(UserError, match=f"{name} belongs to the run around it") as refused:
        export_run_model(finished, finished / name)
    assert "\n" not in str(refused.value) and not (finished / name).exists()
    mine = export_run_model(finished, finished / "mine")  # a name of the user's own beside the run: written ...
    remove_run_files(finished)  # ... and left by the run's --overwrite
    assert (mine / "config.json").is_file()


# --- a damaged metrics.jsonl ------------------------------------------------------------------------------
def test_a_metrics_file_with_bytes_that_are_not_utf8_keeps_its_good_lines(tmp_path):
    """trim_metrics (what --resume does to metrics.jsonl) on a file whose tail is garbage bytes (a copy cut short, a
    damaged disk): the good step lines are kept, the garbage dropped (before: UnicodeDecodeError, a traceback)."""
    from engine.run.folder import trim_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": n, "losses": [1.0]}) for n in (1, 2, 3)]
    path.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe\x00garbage\x9c\n")
    kept = trim_metrics(path, 2)
    assert [r["step"] for r in kept] == [1, 2]
    assert path.read_text(encoding="utf-8").splitlines() == lines[:2]


def test_a_linked_leftover_is_removed_and_its_target_kept(tmp_path):
    """remove_leftovers (run by --resume and --overwrite) on a .model.old that is a link to a user's folder: the link
    goes, the folder stays whole (before: rmtree refused the link silently, and the next export's rename onto it
    failed)."""
    from engine.run.folder import remove_leftovers

    user = tmp_path / "user"
    user.mkdir()
    (user / "keep.txt").write_text("mine\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".model.old").symlink_to(user, target_is_directory=True)
    (out / ".config.json.pid1.x.tmp").symlink_to(user / "keep.txt")
    remove_leftovers(out)
    assert not (out / ".model.old").is_symlink() and not (out / ".config.json.pid1.x.tmp").is_symlink()
    assert (user / "keep.txt").read_text() == "mine\n"


@pytest.mark.parametrize("inside", ["model/ft", "init_progress/ft", "results.json/ft"])
def test_no_output_of_another_kind_starts_inside_a_runs_own_files(tmp_path, inside):
    """A fine-tune's (or zero-shot's, measure's) --out inside RUN/model/ or another of the run's own names is refused
    in one line before anything is written, as a prune run there is: the run's --overwrite would delete it
    (init_progress/), or its --resume refuse to go on beside it (model/). A folder of its own beside the run's files
    is fine (before: every one of them was made)."""
    from engine.storage.outdir import output_folder
    from engine.tools.finetune import FINETUNE_OUTPUT

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "pg-prune-run").write_text("pg-prune run, format version 1\n")
    with pytest.raises(UserError, match="belongs to the run in") as refused:
        with output_folder(run / inside, FINETUNE_OUTPUT):
            pass
    assert "\n" not in str(refused.value) and not (run / inside).exists()
    with output_folder(run / "ft", FINETUNE_OUTPUT) as out:
        (out / "x.txt").write_text("1")
    assert (run / "ft" / "x.txt").is_file()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_resume_with_a_damaged_checkpoint_is_one_line_naming_it(finished, capfd, damage):
    """`prune --resume` whose checkpoint.pt is cut short (a copy interrupted) or garbage: one `error:` line naming the
    file, no traceback, nothing rewritten."""
    ckpt = finished / "checkpoint.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x80\x02garbage" * 100)
    before = user_files(finished)
    capfd.readouterr()
    for extra in ([], ["--steps", "3"]):
        assert main(["prune", "--out", str(finished), "--resume", *extra]) == 2
        one_error(capfd, str(ckpt), "damaged")
    assert user_files(finished) == before


def test_overwrite_refuses_a_folder_under_a_run_files_name_before_deleting_anything(tmp_path, capfd):
    """A folder of the user's named like one of the run's files (RUN/model.f16.gguf/, an old export): --overwrite (and
    the app's delete, remove_run_files) refuse in one line before deleting anything (before: config.json, metrics.jsonl
    and the rest were deleted, then unlink failed on the folder: IsADirectoryError, a traceback, half a run left)."""
    from engine.run.folder import check_out_dir, remove_run_files

    run = tmp_path / "run"
    run.mkdir()
    (run / "pg-prune-run").write_text("pg-prune run, format version 1\n")
    (run / "config.json").write_text("{}\n")
    (run / "metrics.jsonl").write_text("")
    (run / "model.f16.gguf").mkdir()
    (run / "model.f16.gguf" / "mine.txt").write_text("mine\n")
    before = user_files(run)
    for attempt in (lambda: remove_run_files(run), lambda: check_out_dir(run, resume=False, overwrite=True)):
        with pytest.raises(UserError, match=r"--overwrite refused: .*model\.f16\.gguf is a folder") as refused:
            attempt()
        assert "\n" not in str(refused.value)
        assert user_files(run) == before
