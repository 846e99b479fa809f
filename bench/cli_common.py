"""What the bench scripts share on the command line: argparse types that turn bad values into one usage-error
line, and a runner that prints the engine's UserError as one `error: ...` line (no traceback)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # (the package `engine` imports from the install: pip install -e .)


def positive(kind):
    """An argparse type: one value of `kind` above 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return value
    return parse


def csv_list(kind, ok, what: str):
    """An argparse type: comma-separated values of `kind`, each passing `ok`."""
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",")]
        except ValueError:
            values = None
        if values is None or not all(ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return values
    return parse


def run(main) -> None:
    """`main()`, with the engine's UserError (a bad model path, prune ratio, dtype ...) as one error line."""
    from engine.errors import UserError

    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
