"""Paths typed in the app (a model folder to read, a folder to export a model to) stay under the runs folder or under
a folder the user named in $PG_PRUNE_APP_FOLDERS (os.pathsep-separated): whoever reaches the app's page can type any
path, so the page never reads or writes outside the folders the person who started it chose.

    dest = app_path(text, "the export folder")   # a resolved Path, or UserError naming the folders allowed
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UserError

APP_FOLDERS_ENV = "PG_PRUNE_APP_FOLDERS"
RUNS_DIR_ENV = "PG_PRUNE_RUNS_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_runs_dir() -> Path:
    """The app's runs folder: $PG_PRUNE_RUNS_DIR, else runs/ in the repository."""
    return Path(os.environ.get(RUNS_DIR_ENV) or _REPO_ROOT / "runs")


def allowed_folders(env=os.environ) -> list[Path]:
    """The runs folder, then each folder of $PG_PRUNE_APP_FOLDERS, resolved (symbolic links followed)."""
    named = [p.strip() for p in env.get(APP_FOLDERS_ENV, "").split(os.pathsep) if p.strip()]
    return [Path(os.path.realpath(Path(p).expanduser())) for p in (str(default_runs_dir()), *named)]


def app_path(text: str | Path, what: str, env=os.environ) -> Path:
    """`text` as a resolved path (user folder expanded, '..' and symbolic links followed, as far as they exist):
    UserError in one line unless it lies in the runs folder or a folder of $PG_PRUNE_APP_FOLDERS."""
    raw = Path(str(text).strip()).expanduser()
    real = Path(os.path.realpath(raw))
    folders = allowed_folders(env)
    if any(real == f or f in real.parents for f in folders):
        return real
    shown = ", ".join(str(f) for f in folders)
    raise UserError(f"{what} {raw} is outside the folders this app may use ({shown}); choose a path inside one, or "
                    f"add its folder to ${APP_FOLDERS_ENV} before starting the app")


URL_RUN_KEY = "run"  # st.query_params key: the run the pages show, by its folder's name in the runs folder


def run_from_url(value: str | None, runs: Path) -> Path | None:
    """The run folder a URL's ?run=NAME names: a folder directly in the runs folder (no separator, no '..', no
    link), else None (a stale or crafted link shows no run, and reads nothing elsewhere)."""
    if not value or value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
        return None
    path = Path(runs) / value
    return path if path.is_dir() and not path.is_symlink() else None
