"""Tests of interconnect.topology: shapes, ranks, neighbours, links, routes, ring order.

Expectations are derived independently: coordinates from np.unravel_index,
neighbours and distances from coordinate arithmetic over all pairs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interconnect import InterconnectError, TopologyError, Torus, parse_shape

# ------------------------------------------------------------------ helpers


def brute_neighbors(shape, wrap, rank):
    """Neighbours by definition: coordinates differ on one axis by 1 (or size-1 with wraparound)."""
    me = np.unravel_index(rank, shape)
    out = []
    for other in range(int(np.prod(shape))):
        them = np.unravel_index(other, shape)
        diffs = [(axis, abs(int(a) - int(b))) for axis, (a, b) in enumerate(zip(me, them)) if a != b]
        if len(diffs) != 1:
            continue
        axis, d = diffs[0]
        if d == 1 or (wrap[axis] and d == shape[axis] - 1):
            out.append(other)
    return out


def torus_distance(shape, wrap, a, b):
    ca, cb = np.unravel_index(a, shape), np.unravel_index(b, shape)
    total = 0
    for axis, (x, y) in enumerate(zip(ca, cb)):
        d = abs(int(x) - int(y))
        total += min(d, shape[axis] - d) if wrap[axis] else d
    return total


def cycle_exists(shape, wrap):
    """Whether the neighbour graph has a Hamiltonian cycle (graph theory, not the code).

    Grid graphs are bipartite, so an odd number of chips with no odd cycle
    (no wrapping axis of size >= 3) has none; otherwise a snake or comb works.
    """
    axes = [a for a, s in enumerate(shape) if s >= 2]
    n = int(np.prod(shape))
    if len(axes) <= 1:
        return n <= 2 or any(wrap[a] for a in axes)
    return n % 2 == 0 or any(wrap[a] and shape[a] >= 3 for a in axes)


shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).filter(lambda s: int(np.prod(s)) <= 64)


@st.composite
def tori(draw):
    shape = tuple(draw(shapes))
    wrap = tuple(draw(st.booleans()) for _ in shape)
    return Torus(shape, wrap)


# ---------------------------------------------------------------- parse_shape


@pytest.mark.parametrize(
    "text, shape",
    [("8", (8,)), ("2x2", (2, 2)), ("4x4x4", (4, 4, 4)), (" 16 x 16 ", (16, 16)), ("2X4", (2, 4)), ("1", (1,))],
)
def test_parse_shape_accepts(text, shape):
    assert parse_shape(text) == shape


@pytest.mark.parametrize("text", ["", "x", "2x", "x2", "2x2x2x2", "0x2", "-1", "a", "2*2", "2.5", "2xx2"])
def test_parse_shape_rejects_with_value_in_message(text):
    with pytest.raises(TopologyError) as info:
        parse_shape(text)
    assert repr(text) in str(info.value) or text in str(info.value)
    assert "4x4" in str(info.value)  # shows the allowed form
    assert isinstance(info.value, ValueError) and isinstance(info.value, InterconnectError)


def test_parse_shape_rejects_non_string():
    with pytest.raises(TopologyError, match="shape"):
        parse_shape(8)


# -------------------------------------------------------------- construction


def test_torus_normalises_and_names():
    t = Torus((4, 4))
    assert t.wraparound == (True, True)
    assert t.shape == (4, 4) and t.ndim == 2 and t.num_chips == 16 and t.name == "4x4"
    assert Torus([2, 3], False).wraparound == (False, False)
    assert Torus("4x4x4").shape == (4, 4, 4)
    assert Torus((2, 4), (True, False)).wraparound == (True, False)
    assert Torus((4, 4)) == Torus((4, 4), (True, True))
    assert hash(Torus((4, 4))) == hash(Torus((4, 4), True))
    assert parse_shape(Torus((16, 20, 28)).name) == (16, 20, 28)


@pytest.mark.parametrize(
    "shape, wrap, fragment",
    [
        ((), True, "0 axes"),
        ((2, 2, 2, 2), True, "4 axes"),
        ((4, 0), True, "at least 1"),
        ((-2,), True, "at least 1"),
        (("a",), True, "'a'"),
        ((2.5,), True, "2.5"),
        ((4, 4), (True,), "(True,)"),
        ((4, 4), "yes", "'yes'"),
        ((4,), 1, "1"),
    ],
)
def test_torus_rejects(shape, wrap, fragment):
    with pytest.raises(TopologyError) as info:
        Torus(shape, wrap)
    assert fragment in str(info.value)


def test_torus_is_frozen():
    t = Torus((4,))
    with pytest.raises(AttributeError):
        t.shape = (5,)  # type: ignore[misc]


# ------------------------------------------------------------ ranks, coords


@pytest.mark.parametrize("shape", [(1,), (8,), (2, 2), (3, 5), (4, 4, 4), (2, 3, 5), (1, 4, 1)])
def test_coords_rank_round_trip_row_major(shape):
    t = Torus(shape)
    for rank in range(t.num_chips):
        coords = t.coords(rank)
        assert coords == tuple(int(c) for c in np.unravel_index(rank, shape))
        assert t.rank(coords) == rank == int(np.ravel_multi_index(coords, shape))


def test_rank_convention_2x2():
    t = Torus((2, 2))
    assert [t.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("bad", [-1, 16, 1.0, "3", True])
def test_bad_rank_rejected(bad):
    t = Torus((4, 4))
    with pytest.raises(TopologyError) as info:
        t.coords(bad)
    assert repr(bad) in str(info.value) and "0 to 15" in str(info.value)


@pytest.mark.parametrize("bad", [(4, 0), (0,), (0, 0, 0), (-1, 0)])
def test_bad_coords_rejected(bad):
    with pytest.raises(TopologyError, match="coordinates"):
        Torus((4, 4)).rank(bad)


# ------------------------------------------------------ neighbours and links


@pytest.mark.parametrize(
    "shape, wrap, counts",
    [
        ((8,), True, [2] * 8),
        ((8,), False, [1] + [2] * 6 + [1]),
        ((3,), True, [2, 2, 2]),
        ((2,), True, [1, 1]),
        ((2,), False, [1, 1]),
        ((1,), True, [0]),
        ((1, 4), True, [2] * 4),
        ((1, 1, 1), True, [0]),
        ((2, 2), True, [2] * 4),
        ((2, 2, 2), True, [3] * 8),
        ((4, 4), True, [4] * 16),
        ((4, 4, 4), True, [6] * 64),
        ((4, 4), False, [2, 3, 3, 2, 3, 4, 4, 3, 3, 4, 4, 3, 2, 3, 3, 2]),
        ((2, 4), (False, True), [3] * 8),
    ],
)
def test_neighbor_counts(shape, wrap, counts):
    t = Torus(shape, wrap)
    assert [len(t.neighbors(r)) for r in range(t.num_chips)] == counts
    links = t.links()
    assert len(links) == sum(counts)
    assert len(set(links)) == len(links)
    assert all(src != dst for src, dst in links)


@given(tori())
@settings(max_examples=150, deadline=None)
def test_neighbors_links_has_link_match_definition(t):
    wrap = t.wraparound
    links = set(t.links())
    expected_links = set()
    for rank in range(t.num_chips):
        expected = brute_neighbors(t.shape, wrap, rank)
        assert t.neighbors(rank) == expected
        expected_links.update((rank, other) for other in expected)
    assert links == expected_links
    assert len(t.links()) == len(links)  # no duplicates
    for src, dst in itertools.product(range(t.num_chips), repeat=2):
        assert t.has_link(src, dst) == ((src, dst) in expected_links)


# ------------------------------------------------------------------- routes


@given(tori(), st.data())
@settings(max_examples=200, deadline=None)
def test_routes_use_links_and_have_manhattan_hops(t, data):
    src = data.draw(st.integers(0, t.num_chips - 1))
    dst = data.draw(st.integers(0, t.num_chips - 1))
    links = set(t.links())
    path = t.route(src, dst)
    distance = torus_distance(t.shape, t.wraparound, src, dst)
    assert len(path) == distance == t.hops(src, dst)
    assert all(hop in links for hop in path)
    position = src
    axes = []
    for a, b in path:
        assert a == position
        position = b
        (axis,) = [i for i, (x, y) in enumerate(zip(t.coords(a), t.coords(b))) if x != y]
        axes.append(axis)
    assert position == dst
    assert axes == sorted(axes)  # dimension order: axis 0 first


def test_route_examples():
    ring = Torus((8,))
    assert ring.route(0, 7) == [(0, 7)]  # wraparound is the short way
    assert ring.route(0, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # tie: positive direction
    assert Torus((4,)).route(2, 0) == [(2, 3), (3, 0)]  # tie from an even coordinate: positive
    assert Torus((4,)).route(1, 3) == [(1, 0), (0, 3)]  # tie from an odd coordinate: negative
    assert len(Torus((8,), False).route(0, 7)) == 7
    assert ring.route(3, 3) == []
    t = Torus((4, 4), False)
    assert t.route(0, 5) == [(0, 4), (4, 5)]  # axis 0 first
    assert Torus((2,)).route(1, 0) == [(1, 0)]


# --------------------------------------------------------------- ring order


def assert_neighbour_cycle(t):
    order = t.ring_order()
    assert sorted(order) == list(range(t.num_chips))
    for i in range(len(order)):
        a, b = order[i], order[(i + 1) % len(order)]
        if a != b:
            assert torus_distance(t.shape, t.wraparound, a, b) == 1, (a, b)


@pytest.mark.parametrize(
    "shape, wrap",
    [
        ((2, 2), True), ((4, 4), True), ((2, 2, 2), True), ((4, 4, 4), True), ((8,), True),
        ((4, 4), False), ((2, 2, 2), False), ((3, 4), False), ((3, 3), True), ((3, 5, 3), True),
        ((3, 3), (False, True)), ((16, 16), True), ((2,), False), ((1,), True), ((16, 16, 16), True),
    ],
)
def test_ring_order_is_neighbour_cycle(shape, wrap):
    assert_neighbour_cycle(Torus(shape, wrap))


def test_ring_order_examples():
    assert Torus((2, 2)).ring_order() == [0, 1, 3, 2]
    assert Torus((8,)).ring_order() == list(range(8))
    assert Torus((1,)).ring_order() == [0]


@given(tori())
@settings(max_examples=200, deadline=None)
def test_ring_order_best_effort(t):
    order = t.ring_order()
    n = t.num_chips
    assert sorted(order) == list(range(n))
    steps = [torus_distance(t.shape, t.wraparound, order[i], order[(i + 1) % n]) for i in range(n)]
    if n == 1:
        return
    if cycle_exists(t.shape, t.wraparound):
        assert max(steps) == 1
    else:
        # No neighbour cycle: the longest routed step is 2 hops (a line folds
        # back on itself; an odd mesh ends next-but-one to its start).
        assert max(steps) == 2
        if sum(size >= 2 for size in t.shape) >= 2:
            assert sum(step != 1 for step in steps) == 1  # only the closing step is routed


def test_ring_order_large_is_fast():
    import time

    start = time.perf_counter()
    t = Torus((16, 16, 16))
    t.ring_order()
    t.links()
    assert time.perf_counter() - start < 2.0


def test_package_never_imports_ray_pod_or_chip():
    import ast
    import pathlib

    import interconnect

    for path in pathlib.Path(interconnect.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in {"ray", "pod", "chip"}, (path.name, name)


def test_public_api_matches_interfaces():
    import interconnect

    required = """InterconnectError TopologyError Torus parse_shape LinkSpec Transfer Schedule
        ring_allreduce execute ScheduleCost schedule_cost schedule_time""".split()
    assert set(required) <= set(interconnect.__all__)
    assert all(hasattr(interconnect, name) for name in interconnect.__all__)
