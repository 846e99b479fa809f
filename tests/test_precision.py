"""Issue 51, item 5: the one-shot passes (the statistics pass, the init metric, the joint mix) in bfloat16 where the
CPU runs it natively (engine/model/precision.py, --pass-dtype); the evaluations, the steps and the weights keep --dtype."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from engine.model import precision
from engine.model.arch import ModelAdapter
from engine.settings.config import PRESETS, PruneConfig
from engine.model.precision import cpu_flags, native_bf16_cpu, pass_precision, resolve_pass_dtype
from engine.run.loop import PruneRun
from engine.algo.statistics import ColumnMoments, one_pass

from test_adapters_export import build_model
from test_one_pass import stream_of
from test_pruner import small_config

ZEN5 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\nbugs\t\t: none\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
SAPPHIRE = "flags\t\t: avx512f amx_bf16 amx_tile\n"


def test_cpu_flags_are_read_from_the_first_flags_line():
    assert "avx512_bf16" in cpu_flags(ZEN5) and "avx2" in cpu_flags(AVX2)
    assert cpu_flags("processor\t: 0\n") == set()


@pytest.mark.parametrize("text, native", [(ZEN5, True), (AVX2, False), (SAPPHIRE, True)], ids=["avx512-bf16", "avx2", "amx"])
def test_the_cpu_says_whether_it_runs_bfloat16_natively(text, native, tmp_path, monkeypatch):
    monkeypatch.delenv(precision.NATIVE_ENV, raising=False)
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert native_bf16_cpu(str(info)) is native
    assert native_bf16_cpu(str(tmp_path / "missing")) is False  # (a machine that cannot say: float32)
    monkeypatch.setenv(precision.NATIVE_ENV, "0" if native else "1")  # (the environment answers instead)
    assert native_bf16_cpu(str(info)) is not native


@pytest.mark.parametrize("setting, weights, device, native, expected", [
    ("auto", "float32", "cpu", True, "bfloat16"),
    ("auto", "float32", "cpu", False, "float32"),
    ("auto", "float32", "cuda", True, "float32"),  # (a GPU: the weights' dtype unless asked)
    ("auto", "float16", "cpu", True, "float16"),  # (weights in a half type: nothing to gain)
    ("float32", "float32", "cpu", True, "float32"),
    ("bfloat16", "float32", "cpu", False, "bfloat16"),  # (asked for: anywhere, even emulated)
])
def test_the_pass_dtype_resolves(setting, weights, device, native, expected):
    assert resolve_pass_dtype(setting, weights, device, native) == expected


def test_the_bfloat16_context_autocasts_matrix_products_and_float32_changes_nothing():
    layer, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
    with pass_precision("bfloat16"):
        assert layer(x).dtype == torch.bfloat16
    with pass_precision("float32"):
        assert torch.equal(layer(x), layer(x)) and layer(x).dtype == torch.float32
    assert layer(x).dtype == torch.float32  # (the context ends with its block)


def test_statistics_in_bfloat16_are_close_to_float32():
    """FLAP's column moments from a bfloat16 pass: within bfloat16's rounding of the float32 pass's (its 8-bit
    mantissa: about 0.4 % a product), never equal to them (the pass did run in bfloat16)."""
    model = build_model("llama")
    adapter, stream = ModelAdapter.for_model(model), stream_of(model, 3)
    got = {}
    for dtype in ("float32", "bfloat16"):
        reader = ColumnMoments(3)
        with pass_precision(dtype):
            one_pass(adapter, stream, [reader])
        got[dtype] = reader.result
    (m32, s32, n32), (m16, s16, n16) = got["float32"], got["bfloat16"]
    assert n32 == n16 and m32.keys() == m16.keys()
    for k in s32:
        assert torch.allclose(s16[k], s32[k], rtol=0.05, atol=1e-3 * float(s32[k].abs().max())), k
    assert any(not torch.equal(s16[k], s32[k]) for k in s32)


def run_watching_linears(run, model, record) -> dict:
    """run.run() with `record(module, args, out)` hooked on every nn.Linear of `model` (removed after): results."""
    handles = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        return run.run(progress=False)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("native, evals", [("1", "auto"), ("0", "bfloat16")], ids=["native-bf16-cpu", "other-cpu"])
def test_a_run_multiplies_in_bfloat16_only_in_its_one_shot_passes(native, evals, tiny, tiny_path, small_eval_file,
                                                                   tmp_path, monkeypatch):
    """--pass-dtype auto on a CPU with native bfloat16: the statistics pass, Layerwise-PPL and the joint mix's
    forwards multiply in bfloat16, the steps in float32; results.json says which. On another CPU those are float32.
    The evaluations follow --eval-dtype alone (auto: as the passes; bfloat16 asked for: bfloat16 on any CPU)."""
    monkeypatch.setenv(precision.NATIVE_ENV, native)
    model, tokenizer = tiny
    config = small_config(tiny_path, small_eval_file, **{**PRESETS["joint"], "init_batches": 2}, steps=2, budget="params",
                          prune_ratio=0.6, reconstruct=True, reconstruct_batches=2, refit_stream="init", mix_batches=2, pass_dtype="auto",
                          eval_dtype=evals)
    assert PruneConfig().pass_dtype == "auto"  # (the default; a config saved before it was float32's: .of migrates)
    said = []
    run = PruneRun(config, tmp_path / "run", model=model, tokenizer=tokenizer, log=said.append)
    seen: dict[str, set] = defaultdict(set)

    def record(module, args, out):
        seen[run.res.phases.stack[-1][0] if run.res.phases.stack else None].add(out.dtype)

    results = run_watching_linears(run, model, record)
    passes = torch.bfloat16 if native == "1" else torch.float32
    assert results["pass_dtype"] == str(passes).removeprefix("torch.")
    for phase in ("statistics", "init metric", "joint mix"):
        assert seen[phase] == {passes}, (phase, str(dict(seen)))
    assert seen["steps"] == {torch.float32}, dict(seen)
    evaluated = torch.bfloat16 if evals == "bfloat16" else passes
    assert seen["evaluations"] == {evaluated} and results["eval_dtype"] == str(evaluated).removeprefix("torch.")
    # (bfloat16 asked for on a CPU that emulates it: said once, at the start; auto says nothing)
    assert [m for m in said if "without native bfloat16" in m] == (["note: --eval-dtype bfloat16 on a CPU without "
        "native bfloat16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): its matrix products are emulated, several "
        "times slower than float32 here (auto runs float32 on this CPU)"] if native == "0" else [])
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bfloat16_asked_for_where_the_cpu_emulates_it_is_said():
    from engine.model.precision import emulated_bf16_line

    both = PruneConfig.of(pass_dtype="bfloat16", eval_dtype="bfloat16")
    line = emulated_bf16_line(both, "cpu", native=False)
    assert line.startswith("note: --pass-dtype bfloat16 and --eval-dtype bfloat16 on a CPU without native bfloat16")
    assert emulated_bf16_line(both, "cpu", native=True) is None  # (native: nothing to say)
    assert emulated_bf16_line(both, "cuda", native=False) is None  # (a GPU's bfloat16 is its own)
    assert emulated_bf16_line(PruneConfig.of(pass_dtype="auto", eval_dtype="float32"), "cpu", native=False) is None


def test_the_bench_counts_mask_differences_as_the_model_runs_them(monkeypatch):
    """bench/pass_dtype.py: a channel inside a removed layer is removed whatever its own mask says, so two masks
    that differ only there do not differ."""
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from pass_dtype import mask_differences

    a = {"layers": torch.tensor([1.0, 0.0]), "channels": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])}
    b = {"layers": torch.tensor([1.0, 0.0]), "channels": torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])}
    assert mask_differences(a, b) == {"channels": 1, "layers": 0}  # (channel 1; 3-5 are in the removed layer)
    b["layers"] = torch.tensor([1.0, 1.0])
    assert mask_differences(a, b) == {"channels": 3, "layers": 1}  # (1, and 4 and 5 in the layer b now keeps)


def test_within_head_in_float32_the_lm_head_ignores_autocast():
    """Issue 65: the steps' forwards under bfloat16 autocast keep the LM head in float32 (each sample's KL or CE,
    and so the estimate, read float32 logits): inside head_in_float32 the logits equal the float32 head's exactly;
    outside it, under the same autocast, they are bfloat16 products (they differ)."""
    from engine.algo.evaluate import head_chunks, head_in_float32

    model = build_model("llama")
    hidden = torch.randn(2, 5, model.config.hidden_size)
    exact = torch.cat([x for _, x in head_chunks(model, hidden, tokens=4)])
    with pass_precision("bfloat16"):
        rounded = torch.cat([x for _, x in head_chunks(model, hidden, tokens=4)])
        with head_in_float32():
            kept = [x for _, x in head_chunks(model, hidden, tokens=4)]
            assert torch.is_autocast_enabled("cpu")  # (the caller's code between chunks keeps its autocast)
    assert torch.equal(torch.cat(kept), exact) and all(x.dtype == torch.float32 for x in kept)
    assert not torch.equal(rounded, exact) and torch.allclose(rounded, exact, rtol=0.05, atol=0.05)


def test_under_autocast_the_chunked_head_casts_its_weight_once_and_gives_the_heads_own_products():
    """Issue 65: under autocast, head_chunks casts a plain head's weight once for every chunk of a batch (not once
    a chunk, as calling the head would); its logits equal the head's own autocast forward's, chunk for chunk."""
    from engine.algo.evaluate import head_chunks

    model = build_model("llama")
    head = model.get_output_embeddings()
    hidden = torch.randn(2, 5, model.config.hidden_size)
    calls = []
    hook = head.register_forward_hook(lambda m, i, out: calls.append(out.shape))
    try:
        with pass_precision("bfloat16"):
            chunks = [(start, x) for start, x in head_chunks(model, hidden, tokens=4)]
            want = head(hidden.reshape(-1, hidden.shape[-1])).float()
    finally:
        hook.remove()
    assert [start for start, _ in chunks] == [0, 4, 8] and len(calls) == 1  # (the one call: `want`'s)
    assert torch.equal(torch.cat([x for _, x in chunks]), want) and all(x.dtype == torch.float32 for _, x in chunks)


def test_the_step_dtype_resolves_and_bfloat16_is_refused_where_emulated():
    from engine.model.precision import run_step_dtype, step_dtype_problem

    assert PruneConfig().step_dtype == "float32"  # (the default until its quality is measured on 3 seeds)
    asked = PruneConfig.of(step_dtype="bfloat16")
    assert step_dtype_problem(asked, "cpu", native=False).startswith("--step-dtype bfloat16: this CPU does not multiply")
    assert step_dtype_problem(asked, "cpu", native=True) is None and step_dtype_problem(asked, "cuda", native=False) is None
    assert step_dtype_problem(PruneConfig.of(step_dtype="auto"), "cpu", native=False) is None  # (auto: float32 there)
    assert PruneConfig.of(**{k: v for k, v in PruneConfig().to_dict().items() if k != "step_dtype"}).step_dtype == \
        "float32"  # (a config saved before the option: float32, as its steps ran)
    assert run_step_dtype(PruneConfig.of(step_dtype="float32")) == "float32"


@pytest.mark.parametrize("native", ["1", "0"], ids=["native-bf16-cpu", "other-cpu"])
def test_steps_in_bfloat16_run_the_decoder_in_bfloat16_and_the_head_in_float32(native, tiny, tiny_path,
                                                                               small_eval_file, tmp_path, monkeypatch):
    """--step-dtype auto on a CPU with native bfloat16: the steps' masked forwards multiply in bfloat16 inside the
    decoder and in float32 in the LM head, and the step losses stay within bfloat16's rounding of a float32 run's
    (same seed, same masks sampled). On another CPU auto runs float32 and says so, and bfloat16 asked for is
    refused in one line before any work."""
    from engine.errors import UserError

    monkeypatch.setenv(precision.NATIVE_ENV, native)
    model, tokenizer = tiny
    config = small_config(tiny_path, small_eval_file, steps=2, reward="kl", step_dtype="auto", eval_init=False)
    said = []
    run = PruneRun(config, tmp_path / "auto", model=model, tokenizer=tokenizer, log=said.append)
    head = model.get_output_embeddings()
    seen: dict[str, set] = defaultdict(set)

    def record(module, args, out):
        if run.res.phases.stack and run.res.phases.stack[-1][0] == "steps":
            seen["head" if module is head else "decoder"].add(out.dtype)

    results = run_watching_linears(run, model, record)
    stepped = torch.bfloat16 if native == "1" else torch.float32
    assert results["step_dtype"] == str(stepped).removeprefix("torch.")
    assert seen == {"decoder": {stepped}, "head": {torch.float32}}, dict(seen)
    assert [m for m in said if m.startswith("steps in float32")] == (
        [] if native == "1" else ["steps in float32: --step-dtype auto and this CPU has no native bfloat16"])
    if native == "1":
        plain = PruneRun(small_config(tiny_path, small_eval_file, steps=2, reward="kl", step_dtype="float32",
                                      eval_init=False), tmp_path / "f32", model=model, tokenizer=tokenizer,
                         log=lambda m: None)
        plain.run(progress=False)
        lines = [[json.loads(x)["losses"] for x in (p / "metrics.jsonl").read_text().splitlines()]
                 for p in (tmp_path / "auto", tmp_path / "f32")]
        got, want = (torch.tensor(v) for v in lines)
        assert got.shape == want.shape and not torch.equal(got, want)
        assert torch.allclose(got, want, rtol=0.05), (got, want)
    else:
        with pytest.raises(UserError, match=r"^--step-dtype bfloat16: this CPU does not multiply bfloat16 natively"):
            PruneRun(small_config(tiny_path, small_eval_file, steps=2, step_dtype="bfloat16"), tmp_path / "asked",
                     model=model, tokenizer=tokenizer, log=lambda m: None)
        assert not (tmp_path / "asked").exists()
