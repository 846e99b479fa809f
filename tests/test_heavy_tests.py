"""The fast tier's `heavy` marker: tests/heavy_tests.py reads a --durations report, and conftest marks its list."""

from __future__ import annotations

from conftest import REPO
from heavy_tests import heavy, listed, listed_seconds


def test_a_tests_phases_are_summed_against_the_threshold():
    report = "\n".join(["2.00s setup    tests/test_a.py::one", "1.50s call     tests/test_a.py::one",
                        "2.90s call     tests/test_a.py::two[x-1]", "0.01s teardown tests/test_a.py::two[x-1]",
                        "9.00s call     tests/test_b.py::three", "(12 durations < 0.005s hidden.)"])
    assert heavy(report, 3.0) == {"tests/test_a.py::one": 3.5, "tests/test_b.py::three": 9.0}
    assert list(heavy(report, 1.0)) == ["tests/test_a.py::one", "tests/test_a.py::two[x-1]", "tests/test_b.py::three"]


def test_the_list_keeps_each_tests_seconds_and_an_id_without_them_counts_the_threshold(tmp_path):
    path = tmp_path / "heavy.txt"
    path.write_text("# a comment\ntests/test_a.py::one 3.5\ntests/test_b.py::three\n")
    assert listed_seconds(path) == {"tests/test_a.py::one": 3.5, "tests/test_b.py::three": 3.0}
    assert listed(path) == {"tests/test_a.py::one", "tests/test_b.py::three"}


def test_the_files_with_the_most_measured_seconds_are_collected_first(request):
    """Under --dist loadfile the workers take files in collection order: the longest go first."""
    seconds = listed_seconds()
    order, weight = [], {}
    for item in request.session.items:
        path = item.nodeid.split("::")[0]
        if path not in weight:
            order.append(path)
        weight[path] = weight.get(path, 0.0) + seconds.get(item.nodeid, 0.0)
    assert [weight[p] for p in order] == sorted((weight[p] for p in order), reverse=True)


def test_the_listed_tests_are_marked_heavy(request):
    ids = listed()
    assert ids and all((REPO / t.split("::")[0]).parent == REPO / "tests" for t in ids)
    items = request.session.items
    marked = {i.nodeid for i in items if i.get_closest_marker("heavy")}
    assert marked <= ids
    assert {i.nodeid for i in items if i.nodeid in ids} <= marked

