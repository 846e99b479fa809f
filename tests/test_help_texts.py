"""`--help` says what a flag does and its default; measured results live in docs/results.md.

Fast: builds the CLI parser and reads every action's help text; loads no model.
"""

from __future__ import annotations

import argparse
import re

import pytest

# What a measured figure looks like in prose, kept narrow so that a plain default ("default 0.02", "lr 0.002",
# "at most 1 % of them") passes: a spread, a seed list, a paired count, a perplexity-like number (two or more
# digits before the point), a relative gain, a claim over seeds.
FIGURES = {
    "a ± spread": re.compile(r"±|\+-|\+/-"),
    "a seed list": re.compile(r"\bseeds? \d"),
    "a paired count": re.compile(r"\bpaired\b|\bwon\b|\blost\b"),
    "a perplexity-like figure": re.compile(r"(?<![\d.])\d{2,}\.\d+"),
    "a relative gain": re.compile(r"\d+ ?%%? (better|worse|lower|higher)|\b(better|worse) on \d|\bby up to \d"),
    "a claim over seeds": re.compile(r"\b(every|each|all) seeds?\b|\bon \d+ of \d+\b"),
}


def figures_in(text: str) -> list[str]:
    """The kinds of measured figure a help text holds (empty: none)."""
    return [kind for kind, pattern in FIGURES.items() if pattern.search(text)]


def every_help() -> list[tuple[str, str]]:
    """(`subcommand --flag`, help text) for every action of every subcommand of `python -m engine`."""
    from engine.cli import build_parser

    parser = build_parser()
    out = [("(top)", parser.description or "")]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for choice in subparsers._choices_actions:
        out.append((choice.dest, choice.help or ""))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            flag = "/".join(action.option_strings) or action.dest
            out.append((f"{name} {flag}", action.help or ""))
    return out


def test_the_rule_catches_measured_figures():
    for text in ("of 10 paired runs it ended worse on 4 (by up to 15 %), level on 3, better on 3 (by 3-18 %)",
                 "145.9 ± 6.4 on 3 seeds", "seeds 0, 1, 2", "64 refit the masks 3-7 % better than 16",
                 "PG from it beats PG from taylor on every seed measured", "perplexity 152.02"):
        assert figures_in(text), text


def test_the_rule_passes_plain_defaults():
    for text in ("(default 0.02)", "learning rate eta (the paper's is 0.002: --preset paper)", "(default 0.01)",
                 "the scores are saturated (at most 1 % of them between 0.01 and 0.99)", "seeds the calibration stream",
                 "a sample flips about T / 2 of the units at 30 %", "(default 64)", "steps 1000, lr 0.002, N_s 2",
                 "prune-ratio step per stage (default 0.05)", "tokens per segment (the paper: 1024)"):
        assert not figures_in(text), (text, figures_in(text))


def test_help_texts_hold_no_measured_figures():
    found = [f"{where}: {', '.join(kinds)}: {text}" for where, text in every_help() if (kinds := figures_in(text))]
    assert not found, "measured figures in --help (put them in docs/results.md and link it):\n" + "\n".join(found)


@pytest.mark.parametrize("name", ["prune", "eval"])
def test_every_setting_flag_says_its_default(name):
    """Each flag made from a PruneConfig setting names its default."""
    from engine.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    missing = [a.option_strings[0] for a in sub._actions if a.option_strings and a.option_strings[0] not in
               ("-h", "--help", "--config", "--out", "--resume", "--overwrite", "--export-gguf", "--json", "--model")
               and "default" not in (a.help or "")]
    assert not missing, f"{name} flags whose help names no default: {missing}"
