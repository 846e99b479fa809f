"""The registries are the one place a method, a metric, a unit type, an architecture or an executor is added:
an entry registered from outside the engine (as a user's script would) is accepted by the config and used by
the run, and a name can be registered once."""

from __future__ import annotations

import pytest
import torch

from engine.model.arch import ARCHITECTURES, register_architecture
from engine.settings.config import PruneConfig
from engine.errors import UserError
from engine.model.executors import EXECUTORS, register_executor
from engine.export import EXPORT_FORMATS, register_export_format
from engine.algo.methods import METHODS, Method, StepGradient, register_method
from engine.algo.metrics import METRICS, register_metric
from engine.run.loop import PruneRun
from engine.model.unit_types import UNIT_TYPES, register_unit_type

from conftest import SMALL_CALIB, WIKI_RAW


@pytest.fixture
def scratch_entries():
    """Entries a test registers are removed afterwards, so that other tests see the built-in tables."""
    tables = (METHODS, METRICS, EXECUTORS)
    before = [dict(t) for t in tables]
    yield
    for t, b in zip(tables, before):
        t.clear()
        t.update(b)


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="^method 'pg' is already registered$"):
        register_method("pg")(type("Again", (Method,), {}))
    with pytest.raises(ValueError, match="^metric 'wanda-sp' is already registered$"):
        register_metric("wanda-sp", scores="units", needs_data=False)(lambda ctx, units: {})
    with pytest.raises(ValueError, match="^unit type 'channels' is already registered$"):
        register_unit_type(type(UNIT_TYPES["channels"]))
    with pytest.raises(ValueError, match=r"^model type 'llama' already has an adapter \(LlamaLikeAdapter\)$"):
        register_architecture("llama")(ARCHITECTURES["llama"])
    with pytest.raises(ValueError, match="^executor 'batched' is already registered$"):
        register_executor("batched")(EXECUTORS["batched"])
    with pytest.raises(ValueError, match="^export format 'hf' is already registered$"):
        register_export_format("hf", ("f32",))(EXPORT_FORMATS["hf"].fn)
    assert METHODS["pg"].__name__ != "Again" and EXPORT_FORMATS["hf"].outtypes != ("f32",)  # the tables are unchanged


def test_a_new_metric_and_method_are_used_by_the_run(scratch_entries, tiny, tiny_path, tmp_path):
    @register_metric("first-units", scores="units", needs_data=False)
    def first_units(ctx, unit_types):
        """The lower a unit's index in its layer, the higher its score."""
        return {u: [-torch.arange(n, dtype=torch.float32) for n in ctx.layout.sizes[u]] for u in unit_types}

    calls = []

    @register_method("frozen")
    class Frozen(Method):
        """Estimates a zero gradient: the scores never move."""

        def gradient(self, state, batch):
            calls.append(state.step)
            return StepGradient(torch.zeros(1, dtype=torch.float64),
                                {u: torch.zeros_like(s, dtype=torch.float64) for u, s in state.scores.items()}, 0.0)

    config = PruneConfig(model=str(tiny_path), method="frozen", init="first-units", prob_map="score-const", steps=3,
                         units=["kv_groups", "channels"], calib=str(SMALL_CALIB), eval_data=str(WIKI_RAW), max_windows=2,
                         init_batches=1)
    model, tok = tiny
    run = PruneRun(config, tmp_path / "run", model=model, tokenizer=tok, log=lambda m: None)
    results = run.run(progress=False)
    assert calls == [0, 1, 2]
    # the metric ranks the first units of every layer highest, and nothing moved them: they are the ones kept
    meta_kept = results["kept_per_layer"]
    masks = run.res.masks.final_masks(run.load_checkpoint().scores, None)
    for u, mask in masks.items():
        for part, kept in zip(run.res.layout.split(u, mask), meta_kept[u]):
            assert part[:kept].all() and not part[kept:].any()


def test_an_unregistered_name_is_refused():
    for field, value in (("method", "frozen"), ("init", "first-units"), ("sample_forward", "sliced-by-hand")):
        with pytest.raises(UserError, match="unknown"):
            PruneConfig(**{field: value}).validate()
