"""The Prune form's method options reach only their own method (a981e33 broke the page's defaults: "opt-pg-" is
the start of pg-alloc's widget keys, so a pg run got pg-alloc's options and the plan said "unknown pg options")."""

from __future__ import annotations

import dataclasses

import pytest

from engine.algo.methods import METHODS
from engine.ui.settings import default_values, form_config, option_key


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_forms_defaults_give_each_method_its_own_options_only(method):
    values = {**default_values(), "method": method}
    config = form_config(values)
    cls = METHODS[method].Options
    own = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    assert set(config.method_options) == own
    config.validate()  # (the form's defaults are a config the run takes)


def test_an_option_set_in_the_form_reaches_its_method():
    name = next(m for m, cls in METHODS.items() if cls.Options is not None and m.startswith("pg-"))
    field = dataclasses.fields(METHODS[name].Options)[0]
    values = {**default_values(), "method": name, option_key(name, field.name): 0.125}
    assert form_config(values).method_options[field.name] == 0.125
