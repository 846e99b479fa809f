"""Per-row masks, the executors of a PG step, and bias compensation, on tiny random LLaMA / Mistral /
Qwen2 models (and one real tiny run)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model.arch import ModelAdapter
from engine.settings.config import PruneConfig
from engine.algo.evaluate import batch_loss
from engine.model.executors import EXECUTORS, resolve_executor
from engine.export.artifacts import build_pruned_model, export_pruned
from engine.algo.metrics.activations import input_means
from engine.model.masking import MaskHooks
from engine.algo.policy import sample_masks
from engine.run.loop import PruneRun
from engine.model.units import UnitLayout

from test_adapters_export import build_model
from engine.model.unit_types import UNIT_TYPES, unit_sizes

from conftest import quiet

ARCHS = ("llama", "mistral", "qwen2")


def full_layout(model) -> UnitLayout:
    return UnitLayout(unit_sizes(ModelAdapter.for_model(model)))


def batch(model, rows=3, seqlen=17, seed=0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (rows, seqlen), generator=torch.Generator().manual_seed(seed))


def random_samples(layout: UnitLayout, n: int, seed: int, keep: float = 0.6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {u: sample_masks(torch.full((layout.total(u),), keep), n, g) for u in layout.unit_types}


def random_fill(model, seed: int) -> dict[str, list[torch.Tensor]]:
    """Made-up per-column means (non-zero, so that a wrong comp_means shows)."""
    a = ModelAdapter.for_model(model)
    g = torch.Generator().manual_seed(seed)
    return {"kv_groups": [torch.randn(a.attention(i).output.in_features, generator=g) * 0.3 for i in range(a.num_layers)],
            "channels": [torch.randn(a.mlp(i).output.in_features, generator=g) * 0.3 for i in range(a.num_layers)]}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("with_fill", [False, True])
def test_executors_agree(arch, with_fill):
    """Given the same masks and batch, every executor gives the same per-sample losses."""
    model = build_model(arch)
    layout = full_layout(model)
    ids = batch(model)
    comp_means = random_fill(model, 1) if with_fill else None
    for n in (1, 2, 5):
        samples = random_samples(layout, n, seed=n)
        losses = {}
        with MaskHooks(ModelAdapter.for_model(model)) as hooks:
            for name, fn in EXECUTORS.items():
                losses[name] = fn(hooks, layout, ids, samples, comp_means)
        # reference: each sample alone, through the plain whole-batch masks
        ref = torch.empty(n, dtype=torch.float64)
        for j in range(n):
            with MaskHooks(ModelAdapter.for_model(model)) as hooks:
                hooks.set({u: layout.split(u, m[j]) for u, m in samples.items()}, comp_means)
                ref[j] = batch_loss(model, ids).double().mean()
        assert len(set(losses)) >= 2
        for name, got in losses.items():
            assert got.shape == (n,) and got.dtype == torch.float64
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=f"{name} vs one forward per sample")
        assert not torch.allclose(ref, torch.full_like(ref, float(ref[0]))) or n == 1  # the masks do differ


@pytest.mark.parametrize("with_fill", [False, True])
def test_sliced_forward_of_a_layer_that_keeps_no_unit(with_fill):
    """A sample may drop every KV group (or channel) of a layer: the sliced forward still equals the
    masked model (that sub-layer adds nothing, or only its compensation)."""
    from engine.model.slicing import SlicedLayers

    model = build_model("qwen2")  # q/k/v biases: they are sliced too
    a = ModelAdapter.for_model(model)
    layout = UnitLayout({"kv_groups": unit_sizes(a)["kv_groups"], "channels": unit_sizes(a)["channels"]})
    masks = {u: [torch.ones(n) for n in layout.sizes[u]] for u in layout.unit_types}
    masks["kv_groups"][1] = torch.zeros(layout.sizes["kv_groups"][1])
    masks["channels"][2] = torch.zeros(layout.sizes["channels"][2])
    masks["channels"][0][::3] = 0
    comp_means = random_fill(model, 2) if with_fill else None
    ids = batch(model)
    with MaskHooks(a) as hooks:
        hooks.set(masks, comp_means)
        ref = batch_loss(model, ids)
    weights = {n: p.clone() for n, p in model.named_parameters()}
    with SlicedLayers(a, masks, comp_means):
        got = batch_loss(model, ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())  # every weight is back


def test_sliced_layers_restore_the_weights_after_an_error():
    from engine.model.slicing import SlicedLayers

    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    before = {n: p for n, p in model.named_parameters()}
    masks = {"kv_groups": [torch.tensor([1.0, 0.0])] * 3, "channels": [torch.ones(200)] * 3}

    def boom(module, args, output):
        raise RuntimeError("inside the layer")

    handle = a.layer(1).mlp.register_forward_hook(boom)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match="inside the layer"), SlicedLayers(a, masks):
            batch_loss(model, batch(model))
    finally:
        handle.remove()
    assert all(p is before[n] for n, p in model.named_parameters())  # the very same parameters, all of them
    assert torch.get_num_threads() == threads  # the gathers' thread setting is undone too
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in a.layers)


def test_per_row_masks_equal_separate_forwards():
    model = build_model("llama")
    layout = full_layout(model)
    ids = batch(model, rows=4)
    rows = random_samples(layout, 4, seed=9)  # one mask per row
    with MaskHooks(ModelAdapter.for_model(model)) as hooks:
        hooks.set({u: layout.split_rows(u, m) for u, m in rows.items()})
        together = batch_loss(model, ids)
        for r in range(4):
            hooks.set({u: layout.split(u, m[r]) for u, m in rows.items()})
            torch.testing.assert_close(together[r], batch_loss(model, ids[r:r + 1])[0], rtol=1e-5, atol=1e-5)


def test_resolve_executor():
    assert resolve_executor("auto", "cpu") == "sliced"
    assert resolve_executor("auto", "auto") == "sequential"
    assert resolve_executor("auto", "cuda") == resolve_executor("auto", "cuda:1") == "batched"
    assert resolve_executor("sequential", "cuda") == "sequential"


@pytest.mark.parametrize("arch", ARCHS)
def test_compensated_export_equals_masked_model_with_fill(arch, tmp_path, tiny):
    """FLAP-style bias compensation: the export carries W[:, removed] mu as output-projection biases and
    reproduces the masked model whose removed inputs are replaced by their means."""
    model = build_model(arch)
    a = ModelAdapter.for_model(model)
    layout = UnitLayout({"kv_groups": unit_sizes(a)["kv_groups"], "channels": unit_sizes(a)["channels"]})
    g = torch.Generator().manual_seed(3)
    masks = {u: layout.hard_mask(u, torch.rand(layout.total(u), generator=g), "global", 0.6) for u in layout.unit_types}
    ids = batch(model, rows=2, seqlen=19, seed=4)
    comp_means = input_means(a, [batch(model, rows=4, seqlen=19, seed=5)])
    with torch.no_grad(), MaskHooks(a) as hooks:
        hooks.set({u: layout.split(u, m) for u, m in masks.items()}, comp_means)
        compensated = model(input_ids=ids).logits
        hooks.set({u: layout.split(u, m) for u, m in masks.items()})
        plain = model(input_ids=ids).logits
    assert not torch.allclose(compensated, plain, atol=1e-4)  # the compensation means do change the model
    pruned = build_pruned_model(model, layout, masks, comp_means)
    assert pruned.config.output_bias is True
    with torch.no_grad():
        torch.testing.assert_close(pruned(input_ids=ids).logits, compensated, rtol=1e-4, atol=1e-4)
    export_pruned(model, tiny[1], layout, masks, tmp_path / "m", comp_means)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, compensated, rtol=1e-4, atol=1e-4)


def test_all_ones_masks_ignore_the_fill():
    model = build_model("mistral")
    layout = full_layout(model)
    ids = batch(model)
    ones = {u: torch.ones(layout.total(u)) for u in layout.unit_types}
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        with MaskHooks(ModelAdapter.for_model(model)) as hooks:
            hooks.set({u: layout.split(u, m) for u, m in ones.items()}, random_fill(model, 2))
            torch.testing.assert_close(model(input_ids=ids).logits, dense, rtol=0, atol=0)


@pytest.mark.parametrize("options", [
    dict(sample_forward="batched", num_mask_samples=4, mask_sampling="antithetic"),
    dict(sample_forward="batched", num_mask_samples=4, baseline="leave-one-out", control_variate="init-metric"),
    dict(bias_compensation=True, within_layer_ranking="init-metric", units=["kv_groups", "channels", "layers"],
         prune_ratio=0.25),
    dict(method_options=dict(unit_block=16), num_mask_samples=4),
    dict(method_options=dict(unit_block=16), num_mask_samples=4, units=["kv_groups", "channels", "layers"], layer_score_const=1.0),
])
def test_run_with_variance_and_quality_options(options, tiny, tiny_path, tmp_path):
    model, tok = tiny
    config = PruneConfig.of(model=str(tiny_path), steps=3, max_windows=2, init_batches=1, batch_size=2, lr=0.05, **options)
    run = PruneRun(config, tmp_path / "run", model=model, tokenizer=tok, log=quiet)
    config = run.res.config  # (the config the run ran: its method's implied settings and options written out)
    results = run.run(progress=False)
    assert results["status"] == "done" and results["steps"] == 3
    state = run.load_checkpoint()
    if config.within_layer_ranking == "init-metric":
        by_scores = run.res.masks.hard_masks(state.scores)
        final = run.res.masks.final_masks(state.scores, state.init_metric)
        for u in by_scores:  # same per-layer counts, chosen by the metric inside each layer
            assert [int(x.sum()) for x in run.res.layout.split(u, final[u])] == \
                   [int(x.sum()) for x in run.res.layout.split(u, by_scores[u])]
            for part, z in zip(run.res.layout.split(u, final[u]), run.res.layout.split(u, state.init_metric[u])):
                if 0 < part.sum() < part.numel():
                    assert z[part > 0].min() >= z[part == 0].max()
    if config.bias_compensation:
        assert state.input_means is not None and run.res.ctx.comp_means is not None
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model", trust_remote_code=True)
        assert exported.config.output_bias is True
    if config.method_options["unit_block"] > 1:  # the channels moved in blocks; the heads (4 a layer) alone
        blocks, b = state.method_state["blocks"], config.method_options["unit_block"]
        assert list(blocks) == ["channels"]
        ids, s = blocks["channels"], state.scores["channels"].double()
        final = run.res.masks.final_masks(state.scores, state.init_metric)["channels"]
        split = 0
        for k in range(int(ids.max()) + 1):
            members = ids == k
            assert 1 <= int(members.sum()) <= b
            assert len({i // run.res.layout.sizes["channels"][0] for i in torch.nonzero(members).flatten().tolist()}) == 1
            assert float(s[members].max() - s[members].min()) <= 1e-4 + 1e-6  # one probability a block
            split += 0 < float(final[members].sum()) < int(members.sum())
        assert split <= 1  # the final mask keeps or drops whole blocks, but for the one the budget cuts
        start = copy.copy(state)  # the blocks made from the init: the same hard mask as the init's
        start.scores, start.method_state = dict(state.init_scores), {}
        run.res.method._blocks(start)
        assert torch.equal(start.method_state["blocks"]["channels"], ids)
        for u, m in run.res.masks.hard_masks(state.init_scores).items():
            assert torch.equal(run.res.masks.hard_masks(start.scores)[u], m), u
    if config.method_options["control_variate"] == "init-metric":
        assert state.method_state.get("control_moments") is not None and state.method_state.get("control_moments")["count"] == 3


def test_row_losses_equal_the_shifted_cross_entropy():
    """batch_loss shifts the targets instead of copying the shifted logits: the same numbers."""
    import torch.nn.functional as F

    from engine.algo.evaluate import _row_losses

    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(3, 7, 11, generator=g), torch.randint(0, 11, (3, 7), generator=g)
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1), reduction="none").view(3, 6).mean(1)
    torch.testing.assert_close(_row_losses(logits, ids), shifted, rtol=0, atol=0)
    before = ids.clone()
    _row_losses(logits, ids)
    assert ids.equal(before)  # the ids are not changed in place


def test_aligned_padding_is_the_fewest_units_that_align_every_width():
    from engine.model.slicing import aligned_padding

    assert aligned_padding(1075, [1]) == 5 and aligned_padding(1080, [1]) == 0
    assert aligned_padding(3, [64, 64, 64, 192]) == 0  # whole KV groups of 64-wide heads are aligned already
    assert aligned_padding(1, [60, 20]) == 1  # 3 query heads of 20 per group: an even group count
    for kept in range(1, 40):
        for widths in ([1], [20, 60], [12, 36], [3]):
            pad = aligned_padding(kept, widths)
            assert all((kept + pad) * w % 8 == 0 for w in widths)
            assert not any(all((kept + q) * w % 8 == 0 for w in widths) for q in range(pad))  # none fewer


@pytest.mark.parametrize("arch", ARCHS + ("qwen3",))
def test_sliced_forwards_multiply_aligned_widths_and_equal_the_masked_model(arch):
    """The sliced executor pads each layer's gathered units to widths that are multiples of 8 (odd widths take
    MKL's slow path); the padding units repeat a kept one and their output columns are zero, so the forward
    still equals the hook-masked model's, with bias compensation too."""
    from engine.model.slicing import SlicedLayers

    model = build_model(arch)
    a = ModelAdapter.for_model(model)
    layout = UnitLayout({"kv_groups": unit_sizes(a)["kv_groups"], "channels": unit_sizes(a)["channels"]})
    g = torch.Generator().manual_seed(3)
    masks = {u: [(torch.rand(n, generator=g) < 0.6).float() for n in layout.sizes[u]] for u in layout.unit_types}
    masks["channels"][0][:] = 1
    masks["channels"][0][:3] = 0  # 197 of 200 channels: 3 padding units
    masks["kv_groups"][1][:] = 0
    masks["kv_groups"][1][0] = 1  # one KV group of 20-wide heads (llama, mistral): one padding group
    comp_means, ids = random_fill(model, 4), batch(model)
    with MaskHooks(a) as hooks:
        hooks.set(masks, comp_means)
        ref = batch_loss(model, ids)
    widths = []
    watched = [lin for i in range(a.num_layers) for u in layout.unit_types
               for lin, _, _ in UNIT_TYPES[u].owned_weights(a, i)]
    handles = [lin.register_forward_pre_hook(lambda m, args: widths.append(tuple(m.weight.shape))) for lin in watched]
    try:
        with SlicedLayers(a, masks, comp_means):
            got = batch_loss(model, ids)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    dense = {tuple(lin.weight.shape) for lin in watched}
    assert len(widths) == len(watched)
    assert all(rows % 8 == 0 and cols % 8 == 0 or (rows, cols) in dense for rows, cols in widths), widths  # (a dense
    # width is never padded beyond: hidden 96 is aligned, so only a layer keeping every unit of an odd width is not)
    assert (200, 96) in widths  # layer 0's gate/up rows: 197 kept, padded to 200
