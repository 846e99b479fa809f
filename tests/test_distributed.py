"""Data-parallel pruning on torch.distributed (issue 26): `torchrun --nproc-per-node K -m engine prune ...` gives what
one process gives, bit for bit (gloo on the CPU, the tiny model). The faults and resumes on ranks (a rank that dies,
a mismatched world, a resume on another number of ranks, the metric cache) are in test_distributed_faults.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model.distributed import World, dealt, digest, launched, on_cpu, share, shares

from conftest import REPO, SMALL_CALIB, TINY_MODEL, Ran, clean_env, engine_in_process

TIMING = ("seconds", "eta_seconds")
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.pt", "masks.safetensors", "masks.json", "results.json")


# --- the small pure parts --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(1, 1), (3, 2), (2, 2), (8, 3), (1, 2), (2, 5), (7, 7), (0, 3)])
def test_share_covers_every_sample_once_in_order(n, k):
    parts = [share(n, k, r) for r in range(k)]
    assert [j for p in parts for j in p] == list(range(n))  # contiguous, in rank order
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # as even as it gets, the first ranks one more
    assert shares(n, k) == [list(p) for p in parts]


def test_share_of_three_over_two_and_bad_input():
    assert shares(3, 2) == [[0, 1], [2]]
    with pytest.raises(ValueError):
        share(3, 2, 2)
    with pytest.raises(ValueError):
        share(3, 0, 0)


def test_digest_sees_values_and_order():
    a = torch.tensor([0.5, 0.25])
    assert digest({"kv_groups": a}, 1.0) == digest({"kv_groups": a.clone()}, 1.0)
    assert digest({"kv_groups": a}, 1.0) != digest({"kv_groups": a + 1e-7}, 1.0)
    assert digest(a, None) != digest(None, a)
    assert digest(torch.tensor([1.0])) != digest(torch.tensor([1.0], dtype=torch.float64))


def test_one_process_is_the_identity():
    """Outside torchrun the world is one process: the executor is the executor itself, nothing is compared or
    gathered, and no process group is started."""
    assert not launched({}) and not launched({"RANK": "0", "WORLD_SIZE": "1"}) and launched({"RANK": "1", "WORLD_SIZE": "2"})
    w = World()

    def f(*a):
        return a

    assert w.share_executor(f) is f and w.writes and w.from_writer(3, "x") == 3 and w.gather_objects(4, "x") == [4]
    w.check_same("anything", torch.rand(3))  # nobody to disagree with
    from engine.model.distributed import join_world

    assert join_world("cpu", env={}) == World()
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


@pytest.mark.parametrize("n, k", [(5, 2), (3, 3), (1, 2), (0, 2), (7, 3)])
def test_dealt_covers_every_item_once(n, k):
    parts = [dealt(n, k, r) for r in range(k)]
    assert sorted(j for p in parts for j in p) == list(range(n)) and max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [list(p) for p in parts if p] == [list(range(r, n, k)) for r in range(min(k, n))]
    with pytest.raises(ValueError):
        dealt(3, 2, 2)


def test_world_helpers_in_one_process_are_the_plain_computation():
    """map_shares calls fn once on the whole list (no copy to the CPU, no collective); add_up is t itself; mine is
    every item."""
    w, calls = World(), []
    t = torch.rand(3)

    def fn(items):
        calls.append(list(items))
        return [t * x for x in items]

    out = w.map_shares([1, 2, 3], fn, "x", split=dealt)
    assert calls == [[1, 2, 3]] and all(torch.equal(o, t * x) for o, x in zip(out, [1, 2, 3]))
    assert w.add_up(t, "x") is t and list(w.mine(4)) == list(w.mine(4, dealt)) == [0, 1, 2, 3]
    assert w.map_shares([], lambda items: [], "x") == []
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


def test_on_cpu_moves_tensors_in_containers():
    obj = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "s"}
    moved = on_cpu(obj)
    assert moved["b"] == "s" and isinstance(moved["a"][1], tuple) and moved["a"][1][1] == 3
    assert torch.equal(moved["a"][0], torch.ones(2)) and moved["a"][0].device.type == "cpu"


def test_sums_added_in_batch_order_are_one_fold():
    """column_sums' per-batch sums, added in batch order, are the running sum one process accumulates."""
    from engine.algo.metrics.activations import add_in_order

    xs = [{("kv_groups", 0): torch.rand(4) * 10 ** e} for e in (0, 7, -7, 3)]
    running = xs[0][("kv_groups", 0)]
    for x in xs[1:]:
        running = running + x[("kv_groups", 0)]
    assert torch.equal(add_in_order(xs)[("kv_groups", 0)], running) and add_in_order([]) == {}


HELPERS_ON_RANKS = """
import sys, torch
from engine.model.distributed import World, dealt, join_world
w = join_world("cpu")
seen = []
out = w.map_shares(list(range(7)), lambda items: (seen.append(list(items)), [{"j": j, "t": torch.full((2,), float(j))}
                   for j in items])[1], "a test", split=dealt)
assert [o["j"] for o in out] == list(range(7)) and all(torch.equal(o["t"], torch.full((2,), float(o["j"]))) for o in out)
assert seen == [list(dealt(7, 2, w.rank))], seen
assert w.map_shares([5], lambda items: [x + 1 for x in items], "one item") == [6]
a, b = torch.tensor([1.0, 2.0 ** -30], dtype=torch.float32), torch.tensor([2.0 ** -24, 1.0])
total = w.add_up(a if w.rank == 0 else b, "a sum")
assert total.dtype == torch.float32 and torch.equal(total, a + b), (total, a + b)  # as one float32 addition rounds
sys.stdout.write(f"ok {w.rank} {w.size}\\n")  # one write: the ranks share the pipe
sys.stdout.flush()
w.leave()
"""


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_world_helpers_on_two_ranks(tmp_path):
    """map_shares (each rank runs fn on its share only; every rank gets every result in item order, an empty share
    included) and add_up (float64, rounded back as the float32 sum) on 2 gloo ranks."""
    script = tmp_path / "helpers.py"
    script.write_text(HELPERS_ON_RANKS)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
                       cwd=REPO, env=env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(ln for ln in r.stdout.splitlines() if ln.startswith("ok")) == ["ok 0 2", "ok 1 2"]


# --- runs ---------------------------------------------------------------------------------------------------------

def flags(eval_file: Path, steps: int, *extra: str) -> list[str]:
    return ["--model", str(TINY_MODEL), "--steps", str(steps), "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "32",
            "--max-windows", "2", "--init-batches", "1", "--lr", "0.05", "--calib", str(SMALL_CALIB),
            "--eval-data", str(eval_file), "--checkpoint-every", "1", "--method", "pg", *extra]  # (pg: a --method in
    #                                                                        extra overrides it; the default is pg-alloc)


def env(**extra: str) -> dict[str, str]:
    return clean_env(**{"OMP_NUM_THREADS": "1", "PG_PRUNE_DIST_TIMEOUT": "60", **extra})


def single(args: list[str]) -> Ran:
    """`pg-prune prune ARGS` in one process: this one (the ranks are the processes under test; a fresh interpreter
    for each reference run would only import torch and transformers again)."""
    return engine_in_process("prune", *args)


def torchrun(args: list[str], k: int = 2, timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node K -m engine prune ARGS` (torchrun is torch.distributed.run)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={k}",
                           "-m", "engine", "prune", *args], cwd=REPO, env=env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(argvs: list[list[str]], timeout: str = "60") -> list[subprocess.Popen]:
    """The ranks started as torchrun starts them (its environment variables), without its agent, so that a test can
    kill one and watch the others."""
    port, k = free_port(), len(argvs)
    return [subprocess.Popen([sys.executable, "-m", "engine", "prune", *argv], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(k), RANK=str(r),
                                     LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(k), PG_PRUNE_DIST_TIMEOUT=timeout))
            for r, argv in enumerate(argvs)]


def metric_lines(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def no_timing(lines: list[dict], also: tuple[str, ...] = ()) -> list[dict]:
    return [{k: v for k, v in ln.items() if k not in TIMING + also} for ln in lines]


def checkpoint(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=False)


def assert_same_run(a: Path, b: Path, also: tuple[str, ...] = ()) -> None:
    """Bit for bit: every step's losses, baseline, scores and reports; the checkpoint's scores, generators and
    method state; the final masks and the results (but for timing and the world)."""
    from safetensors.torch import load_file

    assert no_timing(metric_lines(a), also) == no_timing(metric_lines(b), also)
    ca, cb = checkpoint(a), checkpoint(b)
    assert ca["step"] == cb["step"]
    best = [c["hooks"].get("validation", {}).get("best_scores") for c in (ca, cb)]  # (validation's own data)
    for key, (xa, xb) in {"scores": (ca["scores"], cb["scores"]), "init_scores": (ca["init_scores"], cb["init_scores"]),
                          "best_scores": best}.items():
        assert (xa is None) == (xb is None)
        for u in xa or {}:
            assert torch.equal(xa[u], xb[u]), (key, u)
    assert ca["baseline"] == cb["baseline"]
    assert torch.equal(ca["mask_rng_state"], cb["mask_rng_state"])  # the same masks were drawn
    assert torch.equal(ca["sampler_state"]["generator"], cb["sampler_state"]["generator"])  # and the same batches
    assert str(ca["method_state"]) == str(cb["method_state"])
    ma, mb = load_file(a / "masks.safetensors"), load_file(b / "masks.safetensors")
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    ra, rb = (json.loads((d / "results.json").read_text()) for d in (a, b))
    varies = {"seconds_per_step", "seconds_in_steps", "seconds_by_phase", "peak_rss_mb", "peak_rss_mb_by_phase",
              "world_size", "mask_samples_by_rank", "worlds",
              "plan_seconds_by_phase"}  # (the plan: from each session's measured load and probe)
    assert {k: v for k, v in ra.items() if k not in varies} == {k: v for k, v in rb.items() if k not in varies}


def one_and_two_ranks(eval_file, tmp_path, steps: int, extra: list[str]):
    """The same run in one process (tmp_path/one) and on 2 ranks (tmp_path/two), checked equal bit for bit:
    (one, two, the 2-rank process)."""
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = single(flags(eval_file, steps, *extra, "--out", str(one)))
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = torchrun(flags(eval_file, steps, *extra, "--out", str(two)))
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert_same_run(one, two)
    return one, two, r2


@pytest.mark.parametrize("case, extra", [  # (each case costs a run in one process and one on 2 ranks: ~25 s)
    # 3 samples: shares of 2 and 1; under kl each rank scores its share against the same dense forward
    ("moving-average+kl", ["--num-mask-samples", "3", "--baseline", "moving-average", "--reward", "kl"]),
    ("antithetic+leave-one-out+control-variate", ["--num-mask-samples", "4", "--mask-sampling", "antithetic",
                                                  "--sample-forward", "sequential", "--baseline", "leave-one-out",
                                                  "--control-variate", "init-metric"]),
])
@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_two_ranks_give_the_single_process_run_bit_for_bit(case, extra, eval_file, tmp_path):
    one, two, r2 = one_and_two_ranks(eval_file, tmp_path, 4, extra)
    res = json.loads((two / "results.json").read_text())
    n = int(extra[1])
    assert res["world_size"] == 2 and res["worlds"] == [{"from_step": 0, "world_size": 2}]
    assert res["mask_samples_by_rank"] == shares(n, 2) and (n != 3 or res["mask_samples_by_rank"] == [[0, 1], [2]])
    assert json.loads((one / "results.json").read_text())["mask_samples_by_rank"] == [list(range(n))]
    # rank 0 alone wrote the run folder (what one process writes, nothing else), and showed progress
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert r2.stdout.count("perplexity (2 windows") == 1 and r2.stderr.count("exporting the sliced model") == 1


INIT_METRICS = [  # every width and layer metric that reads data, and the compensation's means, in 3 cases
    ("layers-layerwise-ppl+wanda-sp+bias-compensation", ["--units", "layers,heads,channels", "--layer-init",
                                                         "layerwise-ppl", "--init", "wanda-sp", "--bias-compensation",
                                                         "--prune-ratio", "0.5"]),
    ("layers-sleb+taylor", ["--units", "layers,heads,channels", "--layer-init", "sleb", "--init", "taylor",
                            "--no-bias-compensation"]),
    # SLEB with a finalist (every candidate on the first batch, the finalist on the other 2, dealt out too), and
    # FLAP's widths
    ("layers-sleb-finalists+flap", ["--units", "layers,heads,channels", "--layer-init", "sleb", "--sleb-finalists",
                                    "1", "--init", "flap", "--prune-ratio", "0.5"]),
]


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
@pytest.mark.parametrize("case, extra", INIT_METRICS)
def test_init_metrics_shared_over_two_ranks_give_the_single_process_run(case, extra, eval_file, tmp_path):
    """The init metrics split over the ranks (3 init batches over 2 ranks: 2 and 1; SLEB's and Layerwise-PPL's
    candidate layers dealt out) give one process's init metric, bias-compensation means, scores, masks and results,
    bit for bit (Taylor too: its float64 sum of two ranks' float32 gradients rounds as the float32 sum does)."""
    extra = [*extra, "--num-mask-samples", "3", "--init-batches", "3", "--layer-init-batches", "3"]
    one, two, _ = one_and_two_ranks(eval_file, tmp_path, 3, extra)
    ca, cb = checkpoint(one), checkpoint(two)
    assert ca["init_metric"].keys() == cb["init_metric"].keys()
    assert all(torch.equal(ca["init_metric"][u], cb["init_metric"][u]) for u in ca["init_metric"])
    units = extra[extra.index("--units") + 1].split(",") if "--units" in extra else ["kv_groups", "channels"]
    compensated = "--no-bias-compensation" not in extra and units != ["layers"]  # (on by default; layers have no widths)
    means_a, means_b = (c["hooks"].get("compensation", {}).get("input_means") for c in (ca, cb))  # (bias compensation's)
    assert (means_a is None) == (not compensated)
    for u in means_a or {}:
        assert all(torch.equal(x, y) for x, y in zip(means_a[u], means_b[u]))
