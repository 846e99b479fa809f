"""Block Influence (ShortGPT) as a layer metric (issue 51): 1 - the mean over tokens of the cosine between a decoder
layer's input and output hidden states, from one forward per batch. Checked against a hand computation from
transformers' own hidden states, in the registry as a layer metric, and in a run alone and inside the joint."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from engine.model.arch import ModelAdapter
from engine.algo.metrics import METRICS, MetricContext, layer_metrics
from engine.model.units import UnitLayout
from engine.model.unit_types import unit_sizes


def tiny_random(model_type: str = "llama", layers: int = 5):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, initializer_range=0.2)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


def by_hand(model, batches: list[torch.Tensor]) -> torch.Tensor:
    """1 - mean cos(h_i, h_i+1) over every token of every batch, from output_hidden_states (h_i: the input of layer
    i; the last entry is the last layer's output after the final norm, an RMS norm whose weight is all ones in a
    fresh model: a positive factor per token, which leaves each token's cosine as it is)."""
    cos, tokens = None, 0
    for batch in batches:
        hs = model(input_ids=batch, output_hidden_states=True).hidden_states
        per_layer = torch.stack([torch.nn.functional.cosine_similarity(hs[i].double(), hs[i + 1].double(), dim=-1).sum()
                                 for i in range(len(hs) - 1)])
        cos = per_layer if cos is None else cos + per_layer
        tokens += batch.numel()
    return 1.0 - cos / tokens


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_block_influence_is_one_minus_the_mean_cosine_of_each_layer(model_type):
    model = tiny_random(model_type)
    a = ModelAdapter.for_model(model)
    assert torch.equal(a.final_norm().weight, torch.ones_like(a.final_norm().weight))  # (by_hand's premise)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (3, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)]
    layout = UnitLayout(unit_sizes(a))
    hooks = lambda: [(len(layer._forward_hooks), len(layer._forward_pre_hooks)) for layer in a.layers]  # noqa: E731
    before = hooks()
    out = METRICS["block-influence"].fn(MetricContext(a, layout, batches), ["layers"])
    assert hooks() == before  # (its hooks removed)
    got = torch.cat(out["layers"]).double()
    expected = by_hand(model, batches)
    assert got.shape == (a.num_layers,)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6), (got, expected)
    assert bool((got > 0).all()) and float(got.std()) > 0  # (a real spread to order the layers by)


def test_block_influence_is_a_one_forward_layer_metric():
    from engine.plan.forecast import _METRIC_FORWARDS

    m = METRICS["block-influence"]
    assert "block-influence" in layer_metrics() and m.scores_layers() and not m.scores_units()
    assert m.needs_data and not m.greedy
    skeleton = SimpleNamespace(decoder_share=1.0)  # (a whole forward's share of the decoder: the plan's unit)
    forwards = [_METRIC_FORWARDS["block-influence"](2, n, m, None, skeleton) for n, m in ((30, 9), (30, 0), (4, 1))]
    assert forwards == [2, 2, 2]  # one forward per batch, whatever the layers


def test_block_influence_runs_alone_and_in_the_joint(tiny, tiny_path, small_eval_file, tmp_path):
    """--units layers --layer-init block-influence --method metric removes the layers of lowest influence; the joint
    (layers, heads and channels on one budget) takes its order for the mix's layers."""
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun

    model, tok = tiny
    common = dict(model=str(tiny_path), eval_data=str(small_eval_file), max_windows=4, seqlen=32, batch_size=2,
                  layer_init="block-influence", method="metric", reconstruct=False, budget="params")
    run = PruneRun(PruneConfig.of(units=["layers"], prune_ratio=0.4, **common), tmp_path / "alone", model=model,
                   tokenizer=tok, log=lambda m: None)
    run.res.loop.progress = False
    results = run.run()
    z = run.load_checkpoint().init_metric["layers"]
    removed = [i for i, k in enumerate(results["kept_per_layer"]["layers"]) if k == 0]
    assert removed == sorted(torch.argsort(z, stable=True)[:len(removed)].tolist()) and removed
    joint = PruneRun(PruneConfig.of(units=["layers", "kv_groups", "channels"], prune_ratio=0.6, init="flap", **common),
                     tmp_path / "joint", model=model, tokenizer=tok, log=lambda m: None)
    joint.res.loop.progress = False
    res = joint.run()
    assert res["layer_init"] == "block-influence" and [m["layers_removed"] for m in res["init_mix"]] == [0, 1]
    z = joint.load_checkpoint().init_metric["layers"]
    removed = [i for i, k in enumerate(res["kept_per_layer"]["layers"]) if k == 0]
    assert removed in ([], [int(torch.argmin(z))])  # (the mix's one layer out: the one of lowest influence)
    saved = json.loads((tmp_path / "joint" / "config.json").read_text())
    assert saved["layer_init"] == "block-influence"
