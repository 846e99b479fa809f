"""UnitLayout: flat score vectors, budget pools per scope, projection per pool, final hard masks."""

from __future__ import annotations

import pytest
import torch

from engine.algo.policy import keep_count, project_capped_simplex
from engine.model.units import UnitLayout

SIZES = {"kv_groups": [4, 4, 3], "channels": [10, 7, 13]}


@pytest.fixture
def layout() -> UnitLayout:
    return UnitLayout({u: list(v) for u, v in SIZES.items()})


def kept_outrank_dropped(scores: torch.Tensor, mask: torch.Tensor) -> bool:
    kept, dropped = scores[mask > 0], scores[mask == 0]
    return len(dropped) == 0 or float(kept.min()) >= float(dropped.max())


def test_geometry(layout):
    assert layout.unit_types == ["kv_groups", "channels"]
    assert layout.total("kv_groups") == 11 and layout.total("channels") == 30
    assert layout.layer_slices("kv_groups") == [slice(0, 4), slice(4, 8), slice(8, 11)]
    flat = torch.arange(30.0)
    parts = layout.split("channels", flat)
    assert [p.tolist() for p in parts] == [list(range(0, 10)), list(range(10, 17)), list(range(17, 30))]
    assert layout.layer_means("channels", flat) == pytest.approx([4.5, 13.0, 23.0])


def test_pools(layout):
    assert layout.pools("kv_groups", "global") == [slice(0, 11)]
    assert layout.pools("channels", "uniform") == layout.layer_slices("channels")
    with pytest.raises(ValueError):
        layout.pools("kv_groups", "per-head")


@pytest.mark.parametrize("keep", [0.25, 0.6, 0.9])
def test_project_uniform_is_per_layer(layout, keep):
    g = torch.Generator().manual_seed(0)
    for u in layout.unit_types:
        z = torch.randn(layout.total(u), generator=g, dtype=torch.float64) + 0.8
        s = layout.project(u, z, "uniform", keep)
        assert float(s.min()) >= 0 and float(s.max()) <= 1
        for sl, part in zip(layout.layer_slices(u), layout.split(u, s)):
            assert float(part.sum()) <= keep * (sl.stop - sl.start) + 1e-6
            assert torch.equal(part, project_capped_simplex(z[sl], keep * (sl.stop - sl.start)))


@pytest.mark.parametrize("keep", [0.25, 0.6, 0.9])
def test_project_global_is_one_pool(layout, keep):
    g = torch.Generator().manual_seed(1)
    for u in layout.unit_types:
        z = torch.randn(layout.total(u), generator=g, dtype=torch.float64) + 0.8
        s = layout.project(u, z, "global", keep)
        assert float(s.sum()) <= keep * layout.total(u) + 1e-6
        assert torch.equal(s, project_capped_simplex(z, keep * layout.total(u)))


@pytest.mark.parametrize("keep", [0.2, 0.5, 0.7, 0.95])
def test_hard_mask_uniform_counts(layout, keep):
    g = torch.Generator().manual_seed(2)
    for u in layout.unit_types:
        s = torch.rand(layout.total(u), generator=g)
        m = layout.hard_mask(u, s, "uniform", keep)
        assert set(m.unique().tolist()) <= {0.0, 1.0}
        for n, part, sp in zip(layout.sizes[u], layout.split(u, m), layout.split(u, s)):
            assert int(part.sum()) == keep_count(keep, n)
            # the kept units are the best of their layer
            assert kept_outrank_dropped(sp, part)


@pytest.mark.parametrize("keep", [0.2, 0.5, 0.7, 0.95])
def test_hard_mask_global_counts(layout, keep):
    g = torch.Generator().manual_seed(3)
    for u in layout.unit_types:
        for _ in range(20):
            s = torch.rand(layout.total(u), generator=g)
            m = layout.hard_mask(u, s, "global", keep)
            # on budget; with fewer kept units than layers, each layer keeps exactly one
            assert int(m.sum()) == max(keep_count(keep, layout.total(u)), len(layout.sizes[u]))
            assert all(int(p.sum()) >= 1 for p in layout.split(u, m))


def test_hard_mask_global_is_top_k_when_no_layer_is_empty():
    layout = UnitLayout({"kv_groups": [3, 3]})
    s = torch.tensor([0.9, 0.1, 0.5, 0.8, 0.7, 0.2])
    assert layout.hard_mask("kv_groups", s, "global", 0.5).tolist() == [1, 0, 0, 1, 1, 0]


def test_repair_keeps_best_unit_of_empty_layer_and_stays_on_budget():
    layout = UnitLayout({"kv_groups": [4, 4, 4]})
    s = torch.tensor([0.90, 0.91, 0.92, 0.93,   # layer 0: best overall
                      0.50, 0.60, 0.70, 0.80,   # layer 1
                      0.10, 0.30, 0.20, 0.05])  # layer 2: all below the global cut
    # plain top-6 keeps layer 0 entirely and 0.8, 0.7 of layer 1, nothing of layer 2. The rule keeps
    # layer 2's best (0.30) and drops the lowest unit kept elsewhere in a layer keeping > 1 (0.70).
    m = layout.hard_mask("kv_groups", s, "global", 0.5)
    assert m.tolist() == [1, 1, 1, 1,
                          0, 0, 0, 1,
                          0, 1, 0, 0]
    assert int(m.sum()) == keep_count(0.5, 12)


def test_repair_of_two_empty_layers():
    layout = UnitLayout({"channels": [4, 3, 5]})
    s = torch.tensor([0.9, 0.8, 0.95, 0.85,
                      0.1, 0.3, 0.2,
                      0.05, 0.01, 0.4, 0.02, 0.03])
    m = layout.hard_mask("channels", s, "global", 4 / 12)  # keep 4: all of layer 0, none elsewhere
    l0, l1, l2 = layout.split("channels", m)
    assert int(m.sum()) == 4
    assert l1.tolist() == [0, 1, 0] and l2.tolist() == [0, 0, 1, 0, 0]  # each empty layer gets its best
    assert l0.tolist() == [1, 0, 1, 0]  # layer 0 gave up its two weakest units (0.8, then 0.85)


def test_repair_when_budget_is_below_one_unit_per_layer():
    """Fewer kept units than layers: every layer still keeps one (an export needs one), budget exceeded."""
    layout = UnitLayout({"kv_groups": [2, 2, 2]})
    s = torch.tensor([0.9, 0.8, 0.1, 0.2, 0.3, 0.05])
    m = layout.hard_mask("kv_groups", s, "global", 0.2)  # keep_count(0.2, 6) = 1
    assert [p.tolist() for p in layout.split("kv_groups", m)] == [[1, 0], [0, 1], [1, 0]]


def test_hard_mask_global_random_properties():
    """Many random layouts/rankings: one unit per layer at least, total on budget, and in every layer
    the kept units outrank the dropped ones (a layer's mask is always a top-k of that layer)."""
    g = torch.Generator().manual_seed(4)
    for trial in range(300):
        n_layers = int(torch.randint(1, 6, (1,), generator=g))
        sizes = torch.randint(1, 9, (n_layers,), generator=g).tolist()
        layout = UnitLayout({"kv_groups": sizes})
        total = layout.total("kv_groups")
        # layer-dependent offsets make whole layers fall below the cut often
        s = torch.cat([torch.rand(n, generator=g) * 0.3 + float(torch.rand(1, generator=g)) for n in sizes])
        keep = float(torch.rand(1, generator=g)) * 0.9 + 0.05
        m = layout.hard_mask("kv_groups", s, "global", keep)
        k = keep_count(keep, total)
        parts, sparts = layout.split("kv_groups", m), layout.split("kv_groups", s)
        assert all(int(p.sum()) >= 1 for p in parts)
        if k >= n_layers:
            assert int(m.sum()) == k
        else:
            assert int(m.sum()) == n_layers
        for p, sp in zip(parts, sparts):
            assert kept_outrank_dropped(sp, p)


def test_hard_mask_deterministic_on_ties():
    layout = UnitLayout({"kv_groups": [3, 3]})
    s = torch.full((6,), 0.5)
    m1 = layout.hard_mask("kv_groups", s, "global", 0.5)
    m2 = layout.hard_mask("kv_groups", s.clone(), "global", 0.5)
    assert torch.equal(m1, m2) and int(m1.sum()) == 3


@pytest.mark.parametrize("scope", ["global", "uniform"])
@pytest.mark.parametrize("seed", range(5))
def test_hard_mask_multiple_keeps_whole_blocks_within_budget(scope, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [96, 128, 100, 64, 33]
    layout = UnitLayout({"channels": sizes})
    scores = torch.rand(layout.total("channels"), generator=g) * torch.repeat_interleave(
        torch.rand(len(sizes), generator=g), torch.tensor(sizes))  # layers of different importance
    plain = layout.hard_mask("channels", scores, scope, 0.55)
    rounded = layout.hard_mask("channels", scores, scope, 0.55, multiple=16)
    for pool in layout.pools("channels", scope):  # never over the budget, and at most one block under per pool
        budget, got = int(plain[pool].sum()), int(rounded[pool].sum())
        assert budget - 16 < got <= budget
    for sl, part in zip(layout.layer_slices("channels"), layout.split("channels", rounded)):
        k = int(part.sum())
        assert k % 16 == 0 and k >= 16
        assert torch.equal(part, torch.zeros_like(part).index_fill_(0, torch.topk(scores[sl], k).indices, 1.0))


def test_round_to_multiple_gives_freed_blocks_to_the_best_layer():
    from engine.model.units import round_to_multiple

    layout = UnitLayout({"channels": [8, 8]})
    scores = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2] + [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0] + [1, 1, 1, 1, 1, 1, 0, 0.0])  # 6 + 6 kept, budget 12
    out = round_to_multiple(mask, scores, layout.layer_slices("channels"), layout.pools("channels", "global"), 4)
    # rounded down to 4 + 4; the freed 4 go to the first layer, whose next 4 units score higher
    assert out.tolist() == [1.0] * 8 + [1.0] * 4 + [0.0] * 4
    # a layer below one block is raised to one; the budget is kept by taking back the weakest last block
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1] + [1, 1, 0, 0, 0, 0, 0, 0.0])  # 8 + 2 kept, budget 10
    out = round_to_multiple(mask, scores, layout.layer_slices("channels"), layout.pools("channels", "global"), 4)
    assert out.tolist() == [1.0] * 4 + [0.0] * 4 + [1.0] * 4 + [0.0] * 4
    # a layer no larger than the multiple is left as it is
    small = UnitLayout({"kv_groups": [3, 3]})
    m = torch.tensor([1, 1, 0, 1, 0, 0.0])
    assert torch.equal(round_to_multiple(m, torch.rand(6), small.layer_slices("kv_groups"), small.pools("kv_groups", "global"), 4), m)


def test_kv_groups_are_read_under_their_older_name_heads(tmp_path):
    """The unit type of a KV head and its query heads is kv_groups; heads, its older name, is read as it in the
    settings (units, --units, unit_multiple) and in a run saved under it (masks.json and masks.safetensors), while
    the registry iterates each unit type once, by its name."""
    import json

    import torch
    from safetensors.torch import save_file

    from engine.cli import _config_from_args, parse_args
    from engine.export.artifacts import load_mask_artifact
    from engine.model.unit_types import UNIT_TYPES, renamed_units, unit_name
    from engine.settings.config import PruneConfig

    assert list(UNIT_TYPES) == ["kv_groups", "channels", "layers"] and "heads" in UNIT_TYPES
    assert UNIT_TYPES["heads"] is UNIT_TYPES["kv_groups"] and UNIT_TYPES.get("heads") is UNIT_TYPES["kv_groups"]
    assert unit_name("heads") == "kv_groups" and unit_name("channels") == "channels" and unit_name(3) == 3
    assert renamed_units({"units": ["heads"], "scores": {"heads": [1]}, "other": {"x": ["heads"]}}) == {
        "units": ["kv_groups"], "scores": {"kv_groups": [1]}, "other": {"x": ["heads"]}}
    config = PruneConfig(units=["heads", "channels"], unit_multiple={"heads": 2})
    assert config.units == ["kv_groups", "channels"] and config.unit_multiple == {"kv_groups": 2}
    assert PruneConfig.from_dict({**config.to_dict(), "units": ["heads"]}).units == ["kv_groups"]
    cli = _config_from_args(parse_args(["prune", "--units", "heads,channels", "--unit-multiple", "heads=2",
                                        "--out", "x"]))
    assert cli.units == ["kv_groups", "channels"] and cli.unit_multiple == {"kv_groups": 2}
    old = tmp_path / "old"  # a finished run's masks as the version that named them heads saved them
    old.mkdir()
    (old / "masks.json").write_text(json.dumps({"unit_types": ["heads"], "units_per_layer": {"heads": [2, 2]}}))
    save_file({"masks.heads": torch.tensor([1.0, 0.0, 1.0, 1.0]), "scores.heads": torch.zeros(4)},
              str(old / "masks.safetensors"))
    meta, masks, scores = load_mask_artifact(old)
    assert meta["unit_types"] == ["kv_groups"] and meta["units_per_layer"] == {"kv_groups": [2, 2]}
    assert set(masks) == set(scores) == {"kv_groups"} and masks["kv_groups"].tolist() == [1.0, 0.0, 1.0, 1.0]
