"""Replica groups in every form XLA writes, their place on the torus, and a collective's
cost on them against the interconnect functions called directly (``pod.hlo.groups``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from chip import get_chip_spec
from interconnect import (
    Torus,
    calibrated_link,
    dcn_collective_seconds,
    group_collective_cost,
    group_ppermute_cost,
    pair_permute_cost,
)
from pod.errors import HloError
from pod.hlo.groups import (
    CollectiveModel,
    Placement,
    group_block,
    parse_pairs,
    parse_replica_groups,
)


def test_explicit_and_empty_groups():
    assert parse_replica_groups("{{0,2},{1,3}}", 4) == ((0, 2), (1, 3))
    assert parse_replica_groups("{}", 4) == ((0, 1, 2, 3),)
    assert parse_replica_groups("", 2) == ((0, 1),)


@pytest.mark.parametrize("groups, dims, perm", [
    ((2, 4), (4, 2), (1, 0)), ((4, 2), (8,), None), ((2, 8), (2, 2, 4), (2, 0, 1)),
    ((1, 16), (16,), None)])
def test_iota_groups_against_explicit_loops(groups, dims, perm):
    """[G,S]<=[dims]T(perm): device at position (p of the transposed array, row-major) is
    the iota index of its coordinates before the transpose."""
    text = f"[{groups[0]},{groups[1]}]<=[{','.join(map(str, dims))}]" + (
        f"T({','.join(map(str, perm))})" if perm else "")
    perm = perm or tuple(range(len(dims)))
    shape = [dims[p] for p in perm]
    flat = []
    for idx in itertools.product(*(range(n) for n in shape)):  # row-major over transposed
        original = [0] * len(dims)
        for axis, value in zip(perm, idx, strict=True):
            original[axis] = value
        flat.append(int(np.ravel_multi_index(original, dims)))
    expect = tuple(tuple(flat[i:i + groups[1]]) for i in range(0, len(flat), groups[1]))
    assert parse_replica_groups(text, int(np.prod(dims))) == expect


def test_mesh_groups():
    """mesh['a'=4,'b'=2] {'a'}: device = a * 2 + b; a group per b, a varying in it."""
    assert parse_replica_groups("mesh['a'=4,'b'=2] {'a'}", 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert parse_replica_groups("mesh['a'=4,'b'=2] {'b'}", 8) == (
        (0, 1), (2, 3), (4, 5), (6, 7))
    assert parse_replica_groups("mesh['a'=4,'b'=2] {'a','b'}", 8) == (tuple(range(8)),)
    # the minor half of a (a = 2 a1 + a0): a0 varies, a1 and b fixed per group
    assert parse_replica_groups("mesh['a'=4,'b'=2] {'a':(2)2}", 8) == (
        (0, 2), (1, 3), (4, 6), (5, 7))


@pytest.mark.parametrize("text", ["[3,3]<=[8]", "[2,4]<=[4,2]T(0,0)", "nonsense",
                                  "mesh['a'=4] {'z'}"])
def test_groups_that_do_not_multiply_out(text):
    with pytest.raises(ValueError):
        parse_replica_groups(text, 8)


def test_pairs():
    assert parse_pairs("{{0,1},{1,2},{2,0}}") == ((0, 1), (1, 2), (2, 0))
    with pytest.raises(ValueError):
        parse_pairs("{{0,1,2}}")


def test_blocks_of_the_torus():
    t = Torus((2, 4), (False, False))
    assert group_block(t, [0, 1, 2, 3]) == (Torus((4,), (False,)), (0, 1, 2, 3))
    assert group_block(t, [4, 0]) == (Torus((2,), (False,)), (0, 4))
    assert group_block(t, [0, 2]) == (Torus((2,), (False,)), (0, 2))          # stride 2
    assert group_block(t, [0, 1, 5]) is None and group_block(t, [0, 1, 3]) is None
    cube = Torus((4, 4, 4), (True, True, True))
    assert group_block(cube, [0, 16, 32, 48])[0] == Torus((4,), (True,))     # a whole ring
    assert group_block(cube, list(range(64)))[0] == cube


def test_tpu_device_order_is_libtpus():
    """libtpu lists a v5e 2x4's devices (x, y) = (0,0), (1,0), (0,1), ...: device i is at
    x = i % 2, y = i // 2, torus rank x * 4 + y."""
    place = Placement(Torus((2, 4), (False, False)))
    assert [place.physical(i) for i in range(8)] == [(i % 2) * 4 + i // 2 for i in range(8)]
    # a bigger slice host by host (2 x 2 chips each, hosts x fastest), as libtpu lists it
    big = Placement(Torus((16, 16), (True, True)))
    coords = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert [big.physical(i) for i in range(8)] == [x * 16 + y for x, y in coords]
    assert big.physical(4 * 8) == 0 * 16 + 2                 # the 9th host starts at (0, 2)
    two = Placement(Torus((2, 2), (False, False)), slices=2)
    assert [two.physical(i) for i in range(8)] == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(HloError, match="not among the 8 devices"):
        two.physical(8)


def test_collective_on_a_block_is_group_collective_cost_on_it():
    chip = get_chip_spec("v5p")
    torus = Torus((4, 4, 4), (True, True, True))
    link = calibrated_link("v5p", chip.ici_link_bandwidth_bytes_per_s, chip.ici_latency_s)
    model = CollectiveModel.of(chip, torus, devices=tuple(range(64)))
    groups = tuple(tuple(range(s, 64, 4)) for s in range(4))                  # 4x4 (y, z) blocks
    got = model.cost("all_gather", groups, 1 << 24, 2)
    want = group_collective_cost("all_gather", torus, groups, (1 << 24) // 2, link, 2,
                                 algorithm="torus", group_torus=Torus((4, 4), (True, True)))
    assert got.seconds == pytest.approx(want.seconds, rel=1e-12)
    assert "xla 4x4 block" in got.algorithm
    ring = model.cost("allreduce", ((0, 1, 2, 5),), 1 << 20, 2)               # not a block
    assert "ring" in ring.algorithm


def test_permute_pairs_equal_the_shift_cost():
    chip = get_chip_spec("v5p")
    torus = Torus((2, 2, 1), (False, False, False))
    link = calibrated_link("v5p", chip.ici_link_bandwidth_bytes_per_s, chip.ici_latency_s)
    model = CollectiveModel.of(chip, torus, devices=tuple(range(4)))
    pairs = ((0, 2), (2, 0), (1, 3), (3, 1))
    got = model.cost("ppermute", pairs, 1 << 26, 2)
    shift = group_ppermute_cost(torus, ((0, 2), (1, 3)), (1 << 26) // 2, link, 2)
    direct = pair_permute_cost(torus, [0, 2, 1, 3], [2, 0, 3, 1], (1 << 26) // 2, link, 2)
    assert got.seconds == pytest.approx(shift.seconds, rel=1e-12)
    assert direct.seconds == pytest.approx(shift.seconds, rel=1e-12)


def test_an_allreduce_across_slices_is_hierarchical():
    """In-slice reduce-scatter, the shard's allreduce over the DCN, in-slice all-gather."""
    chip = get_chip_spec("v5e")
    torus = Torus((2, 2), (False, False))
    link = calibrated_link("v5e", chip.ici_link_bandwidth_bytes_per_s, chip.ici_latency_s)
    model = CollectiveModel.of(chip, torus, slices=2, devices=tuple(range(8)))
    nbytes = 1 << 24
    got = model.cost("allreduce", (tuple(range(8)),), nbytes, 2)
    inner = Torus((2, 2), (False, False))
    rs = group_collective_cost("reduce_scatter", torus, [(0, 1, 2, 3)], nbytes // 2, link, 2,
                               algorithm="torus", group_torus=inner).seconds
    ag = group_collective_cost("all_gather", torus, [(0, 1, 2, 3)], nbytes // 2, link, 2,
                               algorithm="torus", group_torus=inner).seconds
    dcn = dcn_collective_seconds("allreduce", 2, nbytes // 4, chip.dcn_bytes_per_s,
                                 chip.dcn_latency_s)
    assert got.seconds == pytest.approx(rs + dcn + ag, rel=1e-12)
    assert got.dcn_seconds == pytest.approx(dcn, rel=1e-12)
