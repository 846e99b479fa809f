"""The fast tier's `heavy` marker: tests/heavy_tests.py reads a --durations report, and conftest marks its list."""

from __future__ import annotations

from conftest import REPO
from heavy_tests import heavy, listed


def test_a_tests_phases_are_summed_against_the_threshold():
    report = "\n".join(["2.00s setup    tests/test_a.py::one", "1.50s call     tests/test_a.py::one",
                        "2.90s call     tests/test_a.py::two[x-1]", "0.01s teardown tests/test_a.py::two[x-1]",
                        "9.00s call     tests/test_b.py::three", "(12 durations < 0.005s hidden.)"])
    assert heavy(report, 3.0) == ["tests/test_a.py::one", "tests/test_b.py::three"]
    assert heavy(report, 1.0) == ["tests/test_a.py::one", "tests/test_a.py::two[x-1]", "tests/test_b.py::three"]


def test_the_listed_tests_are_marked_heavy(request):
    ids = listed()
    assert ids and all((REPO / t.split("::")[0]).parent == REPO / "tests" for t in ids)
    items = request.session.items
    marked = {i.nodeid for i in items if i.get_closest_marker("heavy")}
    assert marked <= ids
    assert {i.nodeid for i in items if i.nodeid in ids} <= marked

