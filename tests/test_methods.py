"""The paper's whole method: layer pruning, every initialisation, the other estimators and the
one-shot baselines. Pure kernels first, then masks/export on tiny random models, then short runs
on the tiny real model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.algo.metrics import METRICS, MetricContext
from engine.algo.metrics.probability import standardize
from engine.model.units import UnitLayout as _Layout
from engine.model.arch import ModelAdapter
from engine.settings.config import PruneConfig
from engine.errors import UserError
from engine.algo.evaluate import batch_loss, token_loss
from engine.export.artifacts import export_pruned
from engine.model.masking import MaskHooks
from engine.algo.policy import (keep_count, leave_one_out_baselines, policy_gradient, progressive_stages, relaxed_bernoulli,
                           sample_masks, stage_at)
from engine.run.loop import PruneRun
from engine.model.units import UnitLayout

from conftest import clean_env
from test_adapters_export import ARCHS, build_model, masked_logits
from test_pruner import metric_lines, quiet, small_config
from engine.model.unit_types import unit_sizes


# --- pure kernels -------------------------------------------------------------------------------
def test_leave_one_out_baselines():
    losses = torch.tensor([1.0, 2.0, 4.0, 7.0], dtype=torch.float64)
    b = leave_one_out_baselines(losses)
    for j in range(4):
        others = torch.cat([losses[:j], losses[j + 1:]])
        assert float(b[j]) == pytest.approx(float(others.mean()))
    with pytest.raises(ValueError):
        leave_one_out_baselines(torch.tensor([1.0]))


def test_leave_one_out_estimator_is_unbiased():
    """E[L(m)] = a.m + c for Bernoulli(s) masks has gradient a; the leave-one-out baseline does not
    depend on sample j, so the mean of many estimates must match a."""
    g = torch.Generator().manual_seed(3)
    s = torch.tensor([0.2, 0.5, 0.7, 0.9], dtype=torch.float64)
    a = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    n_samples, trials = 3, 20000
    total = torch.zeros_like(s)
    for _ in range(trials):
        m = sample_masks(s, n_samples, g).double()
        losses = m @ a + 5.0
        total += policy_gradient(s, m, losses, leave_one_out_baselines(losses))
    assert torch.allclose(total / trials, a, atol=0.12)


def test_progressive_stages():
    stages = progressive_stages(0.3, 600, 0.05)
    assert [r for _, r in stages] == pytest.approx([0.05, 0.10, 0.15, 0.20, 0.25, 0.30])
    assert [start for start, _ in stages] == [0, 100, 200, 300, 400, 500]
    assert stage_at(stages, 0, 600) == (pytest.approx(0.05), 0, 100)
    assert stage_at(stages, 250, 600) == (pytest.approx(0.15), 50, 100)
    assert stage_at(stages, 599, 600) == (pytest.approx(0.30), 99, 100)
    # a target that is not a multiple of the increment ends exactly at the target
    assert progressive_stages(0.33, 70, 0.05)[-1][1] == pytest.approx(0.33)
    # fewer steps than stages: the last stages get one step each, the target is reached
    short = progressive_stages(0.5, 3, 0.05)
    assert [r for _, r in short] == pytest.approx([0.40, 0.45, 0.50]) and [s for s, _ in short] == [0, 1, 2]


def test_relaxed_bernoulli():
    g = torch.Generator().manual_seed(0)
    s = torch.tensor([0.1, 0.5, 0.9]).repeat(4000).requires_grad_(True)
    soft = relaxed_bernoulli(s, 1.0, g)
    soft_values = soft.detach()
    inside = ((soft_values > 0) & (soft_values < 1)).double().mean()
    assert float(soft_values.min()) >= 0 and float(soft_values.max()) <= 1 and float(inside) > 0.9  # relaxed, not 0/1
    # P(m > 0.5) = s at any temperature: the relaxation is of Bernoulli(s)
    frac = (soft.detach().view(-1, 3) > 0.5).double().mean(0)
    assert torch.allclose(frac, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), atol=0.03)
    # a higher s gives a larger relaxed mask: d(sum m)/ds > 0
    soft.sum().backward()
    assert bool((s.grad > 0).all())
    st = relaxed_bernoulli(s.detach().requires_grad_(True), 0.5, g, straight_through=True)
    assert torch.allclose(st.detach(), st.detach().round(), atol=1e-6)  # forward values are 0/1


def test_layers_are_one_pool_even_when_uniform():
    layout = UnitLayout({"kv_groups": [2, 2, 2, 2], "layers": [1, 1, 1, 1]})
    assert layout.pools("layers", "uniform") == [slice(0, 4)]
    s = torch.tensor([0.9, 0.1, 0.8, 0.2])
    mask = layout.hard_mask("layers", s, "uniform", 0.5)
    assert mask.tolist() == [1.0, 0.0, 1.0, 0.0]  # whole layers dropped, no repair
    assert float(layout.project("layers", torch.full((4,), 0.9), "uniform", 0.5).sum()) == pytest.approx(2.0)


def test_standardize_layers_over_the_pool():
    z = standardize("layers", [torch.tensor([1.0]), torch.tensor([3.0]), torch.tensor([2.0])])
    assert z.tolist() == pytest.approx([-1.0, 1.0, 0.0])
    # units inside layers are standardized per layer
    z = standardize("kv_groups", [torch.tensor([1.0, 3.0]), torch.tensor([10.0, 30.0])])
    assert z.tolist() == pytest.approx(z[:2].tolist() * 2)


# --- layer masks and the export without layers ----------------------------------------------------
@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(7))


def layer_layout(model, units=("kv_groups", "channels", "layers")) -> UnitLayout:
    sizes = unit_sizes(ModelAdapter.for_model(model))
    return UnitLayout({u: sizes[u] for u in units})


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_mask_equals_model_without_that_layer(arch, ids):
    model = build_model(arch)
    layout = layer_layout(model, ("layers",))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    ones = masked_logits(model, layout, {"layers": torch.ones(3)}, ids)
    assert torch.equal(ones, dense.float())
    dropped = masked_logits(model, layout, {"layers": torch.tensor([1.0, 0.0, 1.0])}, ids)
    # the same model with layer 1 taken out of its layer list by hand (llama-style models only read layer_types
    # by position, so keep the config consistent)
    reference = build_model(arch)
    del reference.model.layers[1]
    reference.config.num_hidden_layers = 2
    if getattr(reference.config, "layer_types", None):
        reference.config.layer_types = [reference.config.layer_types[i] for i in (0, 2)]
    with torch.no_grad():
        ref = reference(input_ids=ids, use_cache=False).logits.float()
    assert torch.allclose(dropped, ref, atol=1e-5)
    # leaving the context restores the model
    assert all(type(layer).__name__.endswith("DecoderLayer") for layer in model.model.layers)


def test_soft_layer_mask_blends_and_is_differentiable(ids):
    model = build_model("llama")
    layout = layer_layout(model, ("layers",))
    m = torch.tensor([1.0, 0.5, 1.0], requires_grad=True)
    with MaskHooks(ModelAdapter.for_model(model)) as hooks, torch.enable_grad():
        hooks.set({"layers": layout.split("layers", m)})
        loss = token_loss(model, ids).mean()
        loss.backward()
    assert m.grad is not None and float(m.grad.abs().sum()) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_export_without_layers_reloads_with_plain_transformers(arch, ids, tmp_path, tiny):
    model = build_model(arch)
    layout = layer_layout(model, ("layers",))
    masks = {"layers": torch.tensor([1.0, 0.0, 1.0])}
    export_pruned(model, tiny[1], layout, masks, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == arch and config["num_hidden_layers"] == 2 and "auto_map" not in config
    assert not (tmp_path / "m" / "modeling_pruned.py").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        logits = reloaded(input_ids=ids).logits.float()
    assert torch.allclose(logits, masked_logits(model, layout, masks, ids), atol=1e-5)
    # the renumbered layers line up with the KV cache: cached greedy decoding equals uncached
    prompt = ids[:1, :5]
    cached = reloaded.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    uncached = reloaded.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


READ_BACK = textwrap.dedent("""
    import sys, torch, traceback
    from transformers import AutoModelForCausalLM
    ids = torch.load(sys.argv[1])
    for folder in sys.argv[2:]:
        try:
            m = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            with torch.no_grad():
                torch.save(m(input_ids=ids).logits.float(), folder + ".logits.pt")
        except Exception:
            open(folder + ".error.txt", "w").write(traceback.format_exc())
""")


@pytest.fixture(scope="module")
def exports_with_layers(ids, tiny, tmp_path_factory) -> dict:
    """Per architecture: a model whose layers, KV groups and channels are pruned together, exported; then every
    export read back in one fresh interpreter without the engine (one start for all: ~5 s each on 2 shared cores;
    each folder's failure is its own, in FOLDER.error.txt). arch -> (export folder, the masked model's logits)."""
    root, made = tmp_path_factory.mktemp("exports-with-layers"), {}
    for arch in ("llama", "qwen2"):
        model = build_model(arch)
        layout = layer_layout(model)
        g = torch.Generator().manual_seed(5)
        masks = {u: layout.hard_mask(u, torch.rand(layout.total(u), generator=g), "global", 0.6) for u in ("kv_groups", "channels")}
        masks["layers"] = torch.tensor([0.0, 1.0, 1.0])
        export_pruned(model, tiny[1], layout, masks, root / arch)
        made[arch] = (root / arch, masked_logits(model, layout, masks, ids))
    torch.save(ids, root / "ids.pt")
    proc = subprocess.run([sys.executable, "-c", READ_BACK, str(root / "ids.pt"), *(str(f) for f, _ in made.values())],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env=clean_env(HF_MODULES_CACHE=str(root / "hf_modules")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return made


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_export_layers_heads_channels_together(arch, exports_with_layers):
    folder, expected = exports_with_layers[arch]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == f"pruned_{arch}" and config["num_hidden_layers"] == 2
    assert len(config["kv_heads_per_layer"]) == 2
    error = folder.with_name(folder.name + ".error.txt")
    assert not error.exists(), error.read_text()[-2000:]
    assert torch.allclose(torch.load(folder.with_name(folder.name + ".logits.pt")), expected, atol=1e-5)


# --- metrics --------------------------------------------------------------------------------------
def test_magnitude_sp_is_the_output_projection_column_magnitude():
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    metric = METRICS["magnitude-sp"].fn(MetricContext(a, _Layout(unit_sizes(a))), ["kv_groups", "channels"])
    w = a.mlp(1).output.weight.abs().mean(0)
    assert torch.allclose(metric["channels"][1], w)
    hw = a.attention(2).output.weight.abs().mean(0).view(-1, a.head_dim).sum(1).view(-1, a.queries_per_group).mean(1)
    assert torch.allclose(metric["kv_groups"][2], hw)


def test_taylor_matches_a_hand_computed_unit(ids):
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    metric = METRICS["taylor"].fn(MetricContext(a, _Layout(unit_sizes(a)), [ids]), ["kv_groups", "channels"])
    assert [len(t) for t in metric["kv_groups"]] == unit_sizes(a)["kv_groups"]
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    # by hand: gradient of every parameter, then sum |w * g| over what KV group 1 of layer 0 owns
    reference = build_model("llama").requires_grad_(True)
    token_loss(reference, ids).mean().backward()
    attn = reference.model.layers[0].self_attn
    q, hd = a.queries_per_group * a.head_dim, a.head_dim
    expected = sum(float((p.weight.detach() * p.weight.grad).abs()[rows].sum()) for p, rows in
                   ((attn.q_proj, slice(q, 2 * q)), (attn.k_proj, slice(hd, 2 * hd)), (attn.v_proj, slice(hd, 2 * hd))))
    expected += float((attn.o_proj.weight.detach() * attn.o_proj.weight.grad).abs()[:, q:2 * q].sum())
    assert float(metric["kv_groups"][0][1]) == pytest.approx(expected, rel=1e-4)
    mlp = reference.model.layers[2].mlp
    channel = sum(float((p.weight.detach() * p.weight.grad).abs()[7].sum()) for p in (mlp.gate_proj, mlp.up_proj))
    channel += float((mlp.down_proj.weight.detach() * mlp.down_proj.weight.grad).abs()[:, 7].sum())
    assert float(metric["channels"][2][7]) == pytest.approx(channel, rel=1e-4)


def test_layerwise_ppl_and_sleb(ids):
    model = build_model("llama")
    a = ModelAdapter.for_model(model)
    ctx = MetricContext(a, _Layout(unit_sizes(a)), [ids], keep_ratio=0.34)
    lw = METRICS["layerwise-ppl"].fn(ctx, ["layers"])["layers"]
    for i in range(3):
        keep = torch.ones(3)
        keep[i] = 0
        with MaskHooks(a) as hooks:
            hooks.set({"layers": list(keep.view(3, 1))})
            assert float(lw[i]) == pytest.approx(float(batch_loss(model, ids).double().mean()), rel=1e-6)
    sl = METRICS["sleb"].fn(ctx, ["layers"])  # keep 1 of 3: remove two, greedily
    order = [float(t) for t in sl["layers"]]
    first = min(range(3), key=lambda i: float(lw[i]))
    assert order[first] == 0.0  # SLEB's first removal is the cheapest single removal
    assert sorted(order) == [0.0, 1.0, 2.0]


def test_sleb_s_model_runs_with_and_without_finalists():
    from engine.algo.metrics.sleb import round_runs, sleb_runs

    assert round_runs(5, 4) == round_runs(5, 4, 0) == 20  # every candidate on every batch
    assert round_runs(5, 4, 2) == 5 * 1 + 2 * 3  # all on the first quarter, 2 finalists on the other 3
    assert round_runs(5, 8, 2) == 5 * 2 + 2 * 6
    assert round_runs(2, 4, 2) == round_runs(2, 4, 5) == 8  # as many finalists as candidates: every one everywhere
    assert round_runs(5, 1, 2) == 5  # one batch: nothing to shortlist on
    assert round_runs(5, 4, 2, mine=lambda m: (m + 1) // 2) == 3 * 1 + 1 * 3  # this rank's share of each
    assert sleb_runs(5, 4, 0, 3, 2) == 11 + 10 + 9 and sleb_runs(5, 4, 1, 3, 2) == 10 + 9
    assert sleb_runs(5, 4, 0, 3) == 4 * (5 + 4 + 3)


def _five_layer_llama():
    from transformers import LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


def test_sleb_with_finalists_removes_the_finalist_that_loses_least_on_every_batch():
    """--sleb-finalists 2 on 4 batches: each round every candidate runs on the first batch, the 2 that lose least
    there run on the other 3, and the removal is the one of those 2 with the lower loss over all 4 (recomputed here
    with full forwards); the progress counts those runs. As many finalists as layers is SLEB as published."""
    from engine.algo.metrics.layerwise_ppl import loss_without
    from engine.algo.metrics.registry import removal_order

    a = ModelAdapter.for_model(_five_layer_llama())
    batches = [torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(k)) for k in range(4)]

    def sleb(finalists):
        lines = []
        ctx = MetricContext(a, _Layout(unit_sizes(a)), batches, keep_ratio=0.4, log=lines.append, finalists=finalists)
        return METRICS["sleb"].fn(ctx, ["layers"]), lines

    short, lines = sleb(2)  # 3 of 5 layers out
    assert lines[-1] == "sleb: 30/30 model runs"  # (5 + 2 x 3) + (4 + 2 x 3) + (3 + 2 x 3)
    removed: list[int] = []
    for layer in removal_order(short):
        left = [i for i in range(5) if i not in removed]
        first = {i: loss_without(a, batches[:1], removed + [i]) for i in left}
        finalists = sorted(left, key=lambda i: (first[i], i))[:2]
        full = {i: loss_without(a, batches, removed + [i]) for i in finalists}
        assert layer in finalists and full[layer] <= min(full.values()) + 1e-9
        removed.append(layer)
    assert len(removed) == 3
    exact, exact_lines = sleb(0)
    wide, wide_lines = sleb(5)
    assert [float(t) for t in wide["layers"]] == [float(t) for t in exact["layers"]]
    assert wide_lines[-1] == exact_lines[-1] == "sleb: 48/48 model runs"


def test_sleb_finalists_validate():
    assert PruneConfig().sleb_finalists == 0
    PruneConfig(units=["layers", "kv_groups"], layer_init="sleb", sleb_finalists=3).validate()
    for bad in (dict(sleb_finalists=3), dict(units=["layers"], layer_init="layerwise-ppl", sleb_finalists=3)):
        with pytest.raises(UserError, match="SLEB finalists apply to whole layers scored by SLEB"):
            PruneConfig(**bad).validate()
    with pytest.raises(UserError, match="finalists"):
        PruneConfig(units=["layers"], sleb_finalists=-1).validate()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("removed", [[], [1], [0, 2]])
def test_losses_without_each_layer_equal_full_forwards_without_it(arch, removed):
    """The shortcut (record each layer's input once, then run only the layers after the candidate) gives the
    loss of a full forward with the candidate removed, for every candidate; and ticks once per forward."""
    from engine.algo.metrics.layerwise_ppl import loss_without, losses_without_each

    a = ModelAdapter.for_model(build_model(arch))
    batches = [torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    candidates = [i for i in range(3) if i not in removed]
    ticks = []
    got = losses_without_each(a, batches, removed, candidates, lambda: ticks.append(1))
    assert list(got) == candidates and len(ticks) == len(candidates) * len(batches)
    for i in candidates:
        assert got[i] == pytest.approx(loss_without(a, batches, removed + [i]), rel=1e-6, abs=1e-7)
    # and the candidates differ: a wrong shortcut (e.g. the input not put in) could not pass by accident
    assert len({round(v, 6) for v in got.values()}) == len(got)


def test_no_progress_bar_when_a_metric_makes_no_model_run(capsys):
    """SLEB with its whole order cached makes no model run: no empty bar ("sleb: 0forward") on stderr; a bar
    with runs to count does show."""
    a = ModelAdapter.for_model(build_model("llama"))
    ctx = MetricContext(a, _Layout(unit_sizes(a)), [], progress=True)
    with ctx.progress_bar("sleb", 0):
        pass
    assert capsys.readouterr().err == ""
    with ctx.progress_bar("sleb", 2) as tick:
        tick()
        tick()
    assert "sleb" in capsys.readouterr().err


def test_layer_metric_progress_reaches_the_log_without_a_bar():
    """Without a tqdm bar (the app's runs), SLEB reports its model runs as log lines, the last one complete."""
    a = ModelAdapter.for_model(build_model("llama"))
    lines: list[str] = []
    ctx = MetricContext(a, _Layout(unit_sizes(a)), [torch.randint(0, 128, (2, 19))], keep_ratio=0.34, log=lines.append)
    METRICS["sleb"].fn(ctx, ["layers"])  # removes 2 of 3 layers: 3 + 2 candidate forwards on 1 batch
    assert lines and lines[-1] == "sleb: 5/5 model runs"
    assert all(line.startswith("sleb: ") for line in lines)


# --- runs on the tiny real model --------------------------------------------------------------------
def run_tiny(tiny, tiny_path, eval_file, out, **kw):
    return PruneRun(small_config(tiny_path, eval_file, **kw), out, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)


def test_metric_method_is_the_one_shot_ranking(tiny, tiny_path, small_eval_file, tmp_path):
    results = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", method="metric", scope="uniform")
    assert results["steps"] == 0 and metric_lines(tmp_path / "r") == []
    assert results["ppl_pruned"] == pytest.approx(results["ppl_init"])  # the init mask is the final mask
    kept = results["kept_per_layer"]
    assert kept["kv_groups"] == [keep_count(0.7, 4)] * 2 and kept["channels"] == [keep_count(0.7, 384)] * 2


def test_random_progressive_raises_the_rate_in_stages(tiny, tiny_path, small_eval_file, tmp_path):
    results = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", init="random-progressive", steps=6,
                       prune_ratio=0.3, progressive_increment=0.1)
    lines = metric_lines(tmp_path / "r")
    assert [round(ln["keep_ratio"], 6) for ln in lines] == [0.9, 0.9, 0.8, 0.8, 0.7, 0.7]
    assert lines[2]["lr"] == pytest.approx(lines[0]["lr"])  # cosine restarts in each stage
    assert results["kept_per_layer"]["channels"] and sum(results["kept_per_layer"]["channels"]) == round(0.7 * 768)


@pytest.mark.parametrize("kw", [dict(baseline="leave-one-out", num_mask_samples=3),
                                dict(method="gumbel", lr=0.5), dict(method="gumbel", method_options={"straight_through": True}),
                                dict(init="taylor"), dict(init="magnitude-sp", prob_map="score-const")],
                         ids=["leave-one-out", "gumbel", "gumbel-st", "taylor", "magnitude-score-const"])
def test_estimators_and_inits_run_within_budget(kw, tiny, tiny_path, small_eval_file, tmp_path):
    results = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", steps=3, **kw)
    lines = metric_lines(tmp_path / "r")
    assert len(lines) == 3 and all(len(ln["losses"]) == kw.get("num_mask_samples", PruneConfig().num_mask_samples)
                                 for ln in lines)
    assert lines[0]["mean_score"] != lines[-1]["mean_score"]  # the scores moved
    assert sum(results["kept_per_layer"]["kv_groups"]) == keep_count(0.7, 8)
    assert all(p.grad is None for p in tiny[0].parameters())  # nothing left behind on the shared model


def test_layer_pruning_run_exports_a_shallower_model(tiny, tiny_path, small_eval_file, tmp_path):
    results = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", units=["layers"], prune_ratio=0.5, steps=3)
    assert results["kept_per_layer"]["layers"] in ([1, 0], [0, 1])
    config = json.loads((tmp_path / "r" / "model" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    for layer_init in ("sleb", "random"):
        out = tmp_path / layer_init
        r = run_tiny(tiny, tiny_path, small_eval_file, out, units=["layers", "kv_groups"], layer_init=layer_init,
                     method="metric", prune_ratio=0.5)
        assert sum(r["kept_per_layer"]["layers"]) == 1


@pytest.mark.parametrize("bad", [dict(baseline="leave-one-out", num_mask_samples=1), dict(method="nope"),
                                 dict(layer_init="wanda-sp"), dict(method="metric", init="random-progressive"),
                                 dict(method="gumbel", method_options={"final_temperature": 2.0}),
                                 dict(method="gumbel", method_options={"temperatur": 2.0}),
                                 dict(method="pg", method_options={"temperature": 2.0}),
                                 dict(init="random-progressive", progressive_increment=0.5)])
def test_bad_method_settings_are_user_errors(bad):
    with pytest.raises(UserError):
        PruneConfig.of(**bad).validate()


def test_masked_chat_without_a_layer_matches_the_sliced_export(tiny, tmp_path):
    """Chat's masked mode with layer 0 removed (nothing in its KV cache) answers like the sliced export."""
    from engine.tools.chat import ChatModel, GenerationSettings, answer

    model, tok = tiny
    layout = layer_layout(model, ("layers",))
    masks = {"layers": torch.tensor([0.0, 1.0])}
    export_pruned(model, tok, layout, masks, tmp_path / "m")
    sliced = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    settings = GenerationSettings(max_new_tokens=12, greedy=True)
    masked = ChatModel(model, tok, "masked", 0, layer_masks={"layers": layout.split("layers", masks["layers"])})
    masked_text, _ = answer(masked, "Once upon a time", settings)
    sliced_text, _ = answer(ChatModel(sliced, tok, "sliced", 0), "Once upon a time", settings)
    assert masked_text == sliced_text and len(masked_text.strip()) > 0


COMBOS = {"pg-taylor": dict(init="taylor"), "pg-wanda-sp": dict(init="wanda-sp"), "pg-random": dict(init="random"),
          "pg-magnitude-sp": dict(init="magnitude-sp"),
          "pg-random-progressive": dict(init="random-progressive", progressive_increment=0.15),
          "gumbel": dict(method="gumbel", lr=0.5), "metric-wanda-sp": dict(method="metric", init="wanda-sp"),
          "metric-taylor": dict(method="metric", init="taylor"),
          "layers-sleb": dict(units=["layers"], layer_init="sleb", prune_ratio=0.5),
          "layers-layerwise-ppl": dict(units=["layers"], layer_init="layerwise-ppl", prune_ratio=0.5),
          "joint": dict(units=["layers", "kv_groups", "channels"], prune_ratio=0.6)}


@pytest.mark.parametrize("budget", ["params", "units"])
@pytest.mark.parametrize("scope", ["global", "uniform"])
@pytest.mark.parametrize("combo", list(COMBOS))
def test_every_method_and_init_runs_under_both_budgets(combo, scope, budget, tiny, tiny_path, small_eval_file, tmp_path):
    """Gumbel-softmax, the metric method and every init under --budget params and units, both scopes; under
    params every run removes its share of the decoder's parameters to within one unit's weight."""
    from engine.errors import UserError

    kw = {"steps": 2, "val_batches": 1, **COMBOS[combo]}
    if combo == "joint" and scope == "uniform" and budget == "params":
        with pytest.raises(UserError, match="--scope global"):
            run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", scope=scope, budget=budget, **kw)
        return
    results = run_tiny(tiny, tiny_path, small_eval_file, tmp_path / "r", scope=scope, budget=budget, **kw)
    assert results["status"] == "done" and results["budget"] == budget
    assert results["params_removed"] == results["params_dense"] - results["params_pruned"]
    if budget == "params":
        ratio = kw.get("prune_ratio", 0.3)
        adapter = ModelAdapter.for_model(tiny[0])
        sizes = unit_sizes(adapter)
        from engine.algo.budget import unit_weights
        from engine.model.units import UnitLayout

        weights = unit_weights(adapter, UnitLayout({u: sizes[u] for u in results["units"]}))
        one = max(float(w.max()) for u, w in weights.items() if u != "layers" or len(weights) == 1)
        slack = one * (adapter.num_layers if scope == "uniform" and "layers" not in results["units"] else 1)
        removed, target = results["params_removed"], ratio * results["params_decoder"]
        assert target - 1e-6 <= removed < target + slack, (removed, target, slack)


def test_a_mask_is_evaluated_once(tiny, tiny_path, small_eval_file, tmp_path):
    """A one-shot method's final mask is its init mask: the pruned perplexity is the init's, not a second pass
    over the windows; another mask (PG's after steps, seen through a different mask) is evaluated anew."""
    logs = []
    config = small_config(tiny_path, small_eval_file, method="flap")
    results = PruneRun(config, tmp_path / "r", model=tiny[0], tokenizer=tiny[1], log=logs.append).run(progress=False)
    passes = [m for m in logs if m.startswith("evaluating")]
    assert [m.split(" perplexity")[0] for m in passes] == ["evaluating dense", "evaluating init"]
    assert results["ppl_pruned"] == results["ppl_init"]
    run = PruneRun(small_config(tiny_path, small_eval_file, method="metric"), tmp_path / "s", model=tiny[0],
                   tokenizer=tiny[1], log=logs.append)
    masks = {u: torch.ones(run.res.layout.total(u)) for u in run.res.layout.unit_types}
    first = run.res.masks.masked_perplexity(masks, "a")
    masks["channels"][:5] = 0
    n = len([m for m in logs if m.startswith("evaluating")])
    assert run.res.masks.masked_perplexity(masks, "b") != first and len([m for m in logs if m.startswith("evaluating")]) == n + 1
    assert run.res.masks.masked_perplexity(masks, "c") == run.res.masks.masked_perplexity(dict(masks), "d")
    assert len([m for m in logs if m.startswith("evaluating")]) == n + 1


def test_validate_only_checks_and_resolved_gives_the_config_a_run_runs():
    from engine.errors import UserError
    from engine.settings.config import PruneConfig

    asked = PruneConfig(method="flap", init="wanda-sp", bias_compensation=False)
    before = asked.to_dict()
    assert asked.validate() is asked and asked.to_dict() == before  # checked, changed in nothing
    run = asked.resolved()
    assert run is not asked and asked.to_dict() == before
    assert (run.init, run.bias_compensation) == ("flap", True)  # what FLAP is
    pg = PruneConfig(method="pg").resolved()
    assert pg.method_options and PruneConfig(method="pg").method_options == {}  # its options written out whole
    with pytest.raises(UserError, match="prune ratio"):
        PruneConfig(prune_ratio=1.5).validate()
