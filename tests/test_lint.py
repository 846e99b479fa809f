"""The linter keeps the style (issue 68): `ruff check` over the repository, with pyproject.toml's [tool.ruff] rules
(pyflakes' errors, pycodestyle's, lines up to 140 characters), finds nothing. requirements.txt pins ruff."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import REPO


def ruff_command() -> list[str] | None:
    if shutil.which("ruff"):
        return ["ruff"]
    try:
        import ruff  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ruff"]


@pytest.mark.skipif(ruff_command() is None, reason="ruff is not installed (install.sh installs requirements.txt)")
def test_ruff_finds_nothing():
    proc = subprocess.run([*ruff_command(), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.skipif(ruff_command() is None, reason="ruff is not installed (install.sh installs requirements.txt)")
def test_ruff_sees_an_undefined_name(tmp_path):
    """The rules are the repository's own: a file with an undefined name and a line of 141 characters fails."""
    bad = tmp_path / "bad.py"
    bad.write_text("x = undefined_name\ny = '" + "a" * 135 + "'\n")
    proc = subprocess.run([*ruff_command(), "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "F821" in proc.stdout and "E501" in proc.stdout, proc.stdout
