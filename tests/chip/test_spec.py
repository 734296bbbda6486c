"""Tests of chip.spec: presets against Google's published figures, validation."""

import dataclasses
import json
import math
import pathlib
import re

import pytest

import chip
from chip.spec import CUBE_CHIPS, cube_box
from chip import (PRESETS, ChipError, ChipSpec, ChipSpecError, MXUSpec, TensorCoreSpec,
                  get_chip_spec)

GIB = 2**30

# Google's published bf16 peaks per chip, copied from tpu-specs.md (not from spec.py).
PUBLISHED_BF16_PEAK = {
    "v2": 45e12,  # [SEED] 180e12 per 4-chip board
    "v3": 123e12,
    "v4": 275e12,
    "v5e": 197e12,
    "v5p": 459e12,
    "v6e": 918e12,
}


def derived_peak(spec):
    """2 FLOPs per MAC x every MAC cell of every MXU of every core x clock."""
    core = spec.core
    return 2 * spec.tensorcores * core.mxus_per_core * core.mxu.rows * core.mxu.cols * core.clock_hz


def test_presets_are_the_six_generations():
    assert set(PRESETS) == {"v2", "v3", "v4", "v5e", "v5p", "v6e"}
    for name, spec in PRESETS.items():
        assert spec.name == name
        assert get_chip_spec(name) is spec


@pytest.mark.parametrize("name", sorted(PUBLISHED_BF16_PEAK))
def test_published_peak_is_googles_number(name):
    assert PRESETS[name].published_peak_bf16_flops_per_s == PUBLISHED_BF16_PEAK[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_BF16_PEAK))
def test_derived_peak_matches_published(name):
    spec = PRESETS[name]
    assert spec.peak_bf16_flops_per_s == pytest.approx(derived_peak(spec), rel=1e-12)
    assert spec.core.peak_bf16_flops_per_s * spec.tensorcores == pytest.approx(
        spec.peak_bf16_flops_per_s, rel=1e-12)
    # v2's 45e12 is Google's 180e12-per-board figure divided by 4, itself rounded
    # down from 2 x 16384 x 2 x 0.7e9 = 45.9e12 (1.9% off); every other
    # generation is within 1%.
    rel = 0.02 if name == "v2" else 0.01
    assert spec.peak_bf16_flops_per_s == pytest.approx(PUBLISHED_BF16_PEAK[name], rel=rel)
    if name == "v2":
        # JAX's tpu_info gives v2 4.6e13 per chip [JAX]: within 1% of the derived peak.
        assert spec.peak_bf16_flops_per_s == pytest.approx(4.6e13, rel=0.01)


def test_v2_8_board_is_180_tflops_and_64_gib():
    v2 = get_chip_spec("v2")
    board_chips = 4
    assert board_chips * v2.tensorcores == 8  # "8 TPU cores"
    assert board_chips * v2.peak_bf16_flops_per_s == pytest.approx(180e12, rel=0.02)
    assert board_chips * v2.hbm_bytes == 64 * GIB
    assert v2.core.hbm_bytes == 8 * GIB


@pytest.mark.parametrize("name", sorted(PUBLISHED_BF16_PEAK))
def test_core_share_of_hbm(name):
    spec = PRESETS[name]
    assert spec.core.hbm_bytes == spec.hbm_available_bytes // spec.tensorcores
    assert spec.core.hbm_bandwidth_bytes_per_s * spec.tensorcores == pytest.approx(
        spec.hbm_bandwidth_bytes_per_s)
    assert spec.core.vpu_lanes == 128 and spec.core.vpu_sublanes == 8
    assert spec.core.transcendental_cycles_per_element_op > 1


def test_table_figures():
    expect = {  # name: (cores, mxus/core, rows, hbm_bytes, hbm B/s, links, link B/s, shape, per host)
        "v2": (2, 1, 128, 16 * GIB, 7.16e11, 4, 62e9, (16, 16), 4),
        "v3": (2, 2, 128, 32 * GIB, 900e9, 4, 1e11, (32, 32), 4),
        "v4": (2, 4, 128, 32 * GIB, 1200e9, 6, 4.5e10, (16, 16, 16), 4),
        "v5e": (1, 4, 128, 16e9, 819e9, 4, 4.5e10, (16, 16), 8),
        "v5p": (2, 4, 128, 95 * GIB, 2765e9, 6, 9e10, (16, 20, 28), 4),
        "v6e": (1, 4, 256, 32e9, 1638e9, 4, 9e10, (16, 16), 8),
    }
    for name, (cores, mxus, rows, hbm, bw, links, link_bw, shape, per_host) in expect.items():
        s = PRESETS[name]
        assert s.tensorcores == cores, name
        assert s.core.mxus_per_core == mxus, name
        assert s.core.mxu == MXUSpec(rows, rows), name
        assert s.hbm_bytes == hbm, name
        assert s.hbm_bandwidth_bytes_per_s == bw, name
        assert s.ici_links == links, name
        assert s.ici_link_bandwidth_bytes_per_s == link_bw, name
        assert s.max_pod_shape == shape and s.torus_dims == len(shape), name
        assert s.chips_per_host == per_host, name
        assert s.ici_latency_s == 1e-6, name
        assert s.host_to_chip_bytes_per_s == (3.2e10 if name == "v6e" else 1.6e10), name
        assert s.slice_counts_tensorcores == (name in {"v2", "v3", "v4", "v5p"}), name
    assert PRESETS["v5p"].max_pod_chips == 8960
    assert PRESETS["v4"].max_pod_chips == 4096


def test_every_preset_figure_cites_a_source():
    source = pathlib.Path(chip.spec.__file__).read_text()
    blocks = re.findall(r"ChipSpec\.from_chip_figures\((.*?)\n\)", source, flags=re.S)
    assert len(blocks) == 6
    for block in blocks:
        for line in block.strip().splitlines():
            if "=" not in line or line.strip().startswith(("name=", "#")):
                continue
            assert re.search(r"#.*(\[[A-Z]+[-\w]*|der\.|table|assumption|fit)", line), line


def test_specs_are_frozen():
    spec = get_chip_spec("v4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tensorcores = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.core.clock_hz = 1.0


def test_unknown_name_lists_choices():
    with pytest.raises(ChipSpecError) as info:
        get_chip_spec("v9")
    message = str(info.value)
    assert "'v9'" in message
    for name in PRESETS:
        assert repr(name) in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, ChipError)


@pytest.mark.parametrize("rows, cols", [(0, 128), (128, -1), (1.5, 2), (True, 2)])
def test_mxu_spec_rejects_bad_shape(rows, cols):
    with pytest.raises(ValueError) as info:
        MXUSpec(rows, cols)
    assert repr(rows) in str(info.value) or repr(cols) in str(info.value)


def _core(**overrides):
    fields = dict(mxu=MXUSpec(4, 4), mxus_per_core=1, clock_hz=1e9, hbm_bytes=1024,
                  hbm_bandwidth_bytes_per_s=1e9, vmem_bytes=0)
    fields.update(overrides)
    return TensorCoreSpec(**fields)


@pytest.mark.parametrize("field, bad", [("clock_hz", -1.0), ("clock_hz", math.nan),
                                        ("hbm_bytes", 0), ("mxus_per_core", 0),
                                        ("hbm_bandwidth_bytes_per_s", 0.0),
                                        ("vpu_lanes", 0), ("scalar_issue_cycles", -2)])
def test_core_spec_rejects_bad_values(field, bad):
    with pytest.raises(ValueError) as info:
        _core(**{field: bad})
    assert field in str(info.value) and repr(bad) in str(info.value)


def test_chip_spec_rejects_inconsistent_core_share():
    v2 = get_chip_spec("v2")
    with pytest.raises(ChipSpecError, match="hbm_available_bytes // tensorcores"):
        dataclasses.replace(v2, hbm_available_bytes=v2.hbm_bytes // 2)
    with pytest.raises(ChipSpecError, match="max_pod_shape"):
        dataclasses.replace(v2, max_pod_shape=(16, 16, 16))
    with pytest.raises(ChipSpecError, match="-3"):
        dataclasses.replace(v2, ici_links=-3)


def test_from_chip_figures_splits_hbm_over_cores():
    spec = ChipSpec.from_chip_figures(
        name="toy", tensorcores=2, mxu=MXUSpec(8, 8), mxus_per_core=1, clock_hz=1e9,
        hbm_bytes=1000, hbm_bandwidth_bytes_per_s=2e9, vmem_bytes_per_core=0,
        ici_links=2, ici_link_bandwidth_bytes_per_s=1e9, ici_latency_s=0.0, torus_dims=1,
        max_pod_shape=[4], chips_per_host=1, host_to_chip_bytes_per_s=1e9,
        published_peak_bf16_flops_per_s=None, slice_counts_tensorcores=False,
        scalar_issue_cycles=0)
    assert spec.core.hbm_bytes == 500
    assert spec.core.hbm_bandwidth_bytes_per_s == 1e9
    assert spec.core.scalar_issue_cycles == 0
    assert spec.max_pod_shape == (4,)
    assert spec.peak_bf16_flops_per_s == 2 * 2 * 64 * 1e9


def test_vpu_has_two_alus_per_lane_and_v5p_does_7e12():
    # "2048 floating point adders" per v4 TensorCore [SB-tpus]: 8 x 128 x 2.
    v4 = get_chip_spec("v4")
    assert v4.core.vpu_elements_per_cycle == 2048
    # "The TPU v5p VPU can do roughly 7e12 FLOPs / second" [SB-roof]: per chip.
    v5p = get_chip_spec("v5p")
    assert v5p.peak_vpu_flops_per_s == pytest.approx(7e12, rel=0.05)
    assert v5p.peak_vpu_flops_per_s == 2 * 8 * 128 * 2 * 1.75e9


def test_megacore_flag_is_v4_and_v5p():
    # v4 and v5p run their two TensorCores as one megacore [GC-v4][SB]; v2 and
    # v3 have two separate cores; v5e and v6e have one.
    assert {name for name, s in PRESETS.items() if s.megacore} == {"v4", "v5p"}
    with pytest.raises(ChipSpecError, match="megacore"):
        dataclasses.replace(get_chip_spec("v5e"), megacore=True)
    with pytest.raises(ChipSpecError, match="megacore"):
        dataclasses.replace(get_chip_spec("v4"), megacore="yes")


@pytest.mark.parametrize("field", ["mxu_efficiency", "hbm_efficiency"])
@pytest.mark.parametrize("bad", [0.0, -0.5, 1.01, float("nan"), True])
def test_efficiencies_are_fractions(field, bad):
    with pytest.raises(ChipSpecError, match=field):
        dataclasses.replace(get_chip_spec("v5e").core, **{field: bad})


def test_achieved_hbm_bandwidth_is_spec_times_efficiency():
    for spec in PRESETS.values():
        core = spec.core
        assert 0 < core.hbm_efficiency <= 1 and 0 < core.mxu_efficiency <= 1
        assert core.achieved_hbm_bandwidth_bytes_per_s == pytest.approx(
            core.hbm_bandwidth_bytes_per_s * core.hbm_efficiency)


# Google Cloud's slice tables, copied from the system architecture pages (not from
# spec.py): name -> chips per axis [GC-v4], [GC-v5e], [GC-v5p].
PUBLISHED_SLICES = {"v4-32": (2, 2, 4), "v4-4096": (8, 16, 16), "v5e-8": (2, 4),
                    "v5e-256": (16, 16), "v5p-128": (4, 4, 4), "v6e-64": (8, 8)}


def test_every_preset_slice_holds_its_names_count():
    """A slice's shape holds count / tensorcores chips where the name counts TensorCores
    (v2, v3, v4, v5p) and count chips otherwise; its axes are the generation's torus's."""
    for name, spec in PRESETS.items():
        assert spec.slice_shapes, name
        per_chip = spec.tensorcores if name in {"v2", "v3", "v4", "v5p"} else 1
        for count, shape in spec.slice_shapes:
            assert len(shape) == spec.torus_dims, (name, count)
            assert math.prod(shape) * per_chip == count, (name, count)
            assert all(a <= b for a, b in zip(sorted(shape), sorted(spec.max_pod_shape)))
    for slice_name, shape in PUBLISHED_SLICES.items():
        generation, count = slice_name.split("-")
        assert get_chip_spec(generation).slice_shape(int(count)) == shape, slice_name
    assert get_chip_spec("v5e").slice_shape(12) is None


@pytest.mark.parametrize("field, bad, match", [
    ("slice_shapes", ((8, (2, 2)),), "v4-8 has shape"),                 # 2-D on a 3-D torus
    ("slice_shapes", ((16, (2, 2, 2)), (8, (2, 2, 2))), "v4-8 has shape"),  # 8 chips, not 4
    ("slice_shapes", ((8, (2, 2, 1)), (8, (2, 2, 1))), "names a count twice"),
    ("slice_shapes", (8,), "must be \\(count, shape\\) pairs"),
    ("wraparound_rule", "sometimes", "wraparound_rule must be one of"),
])
def test_a_preset_with_a_slice_that_does_not_hold_its_count_is_refused(field, bad, match):
    with pytest.raises(ChipSpecError, match=match):
        dataclasses.replace(get_chip_spec("v4"), **{field: bad})


@pytest.mark.parametrize("name, shape, wraps", [
    ("v2", (4, 4), (True, True)), ("v3", (1, 4), (False, True)),
    ("v5e", (16, 16), (True, True)), ("v5e", (16, 8), (True, False)),
    ("v6e", (8, 8), (False, False)),
    ("v4", (4, 4, 8), (True, True, True)), ("v4", (2, 2, 4), (False, False, False)),
    ("v5p", (16, 20, 28), (True, True, True)), ("v5p", (4, 4, 6), (False, False, False)),
])
def test_wraparound_follows_the_generations_rule(name, shape, wraps):
    """[SB]: v2 / v3 slices are tori; v5e / v6e wrap an axis only at its full 16; v4 /
    v5p wrap every axis of a slice of whole 4x4x4 cubes and none otherwise."""
    assert get_chip_spec(name).default_wraparound(shape) == wraps


_ORACLE_RESULTS = pathlib.Path(__file__).resolve().parents[2] / "tools" / "xla_oracle" / "results"


def test_available_hbm_is_what_xla_made_available_in_the_oracles_compiles():
    """The presets' ``hbm_available_bytes`` is XLA's own figure: every out-of-memory compile
    of the oracle (tools/xla_oracle/results) names the HBM available to the program, and a
    device of those generations is one chip (megacore or one TensorCore)."""
    seen: dict[str, set[int]] = {}
    for path in sorted(_ORACLE_RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        oom = (result.get("compile") or {}).get("oom") or {}
        if oom.get("available_bytes"):
            seen.setdefault(result["chip"], set()).add(int(oom["available_bytes"]))
    assert {"v4", "v5e", "v5p", "v6e"} <= set(seen), seen
    for chip_name, figures in seen.items():
        spec = get_chip_spec(chip_name)
        assert figures == {spec.hbm_available_bytes}, (chip_name, figures)
        assert spec.core.hbm_bytes * spec.tensorcores <= spec.hbm_available_bytes


def test_available_hbm_defaults_to_the_published_capacity():
    v2 = get_chip_spec("v2")
    assert v2.hbm_available_bytes == v2.hbm_bytes
    assert get_chip_spec("v4").hbm_available_bytes < get_chip_spec("v4").hbm_bytes


@pytest.mark.parametrize("generation", ["v4", "v5p"])
def test_cube_built_slices_reproduce_the_table(generation):
    """Every shape of the table made of whole 4x4x4 cubes is the box cube_box gives for its
    number of cubes (the rule names the slices the table leaves out, such as v4-384)."""
    spec = get_chip_spec(generation)
    for count, shape in spec.slice_shapes:
        chips = math.prod(shape)
        if chips >= CUBE_CHIPS:
            assert cube_box(chips // CUBE_CHIPS, spec.max_pod_shape) == tuple(sorted(shape))


def test_cube_built_slice_names():
    """v4-384 is 3 cubes in a row, 4x4x12, with wraparound on every axis [SB]; a count of
    part of a cube or more cubes than the largest pod holds is no slice."""
    v4, v5p = get_chip_spec("v4"), get_chip_spec("v5p")
    assert v4.slice_shape(384) == (4, 4, 12)
    assert v4.default_wraparound((4, 4, 12)) == (True, True, True)
    assert v4.slice_shape(768) == (4, 8, 12)  # 6 cubes: 1 x 2 x 3
    assert v4.slice_shape(200) is None  # 100 chips: not whole cubes
    assert v4.slice_shape(896) is None  # 7 cubes in a row: 28 chips, the pod's side is 16
    assert v5p.slice_shape(896) == (4, 4, 28)  # v5p's largest pod is 16x20x28
    assert get_chip_spec("v5e").slice_shape(192) is None  # a 2-D generation: the table only
    for cubes in range(1, 65):
        box = cube_box(cubes, v4.max_pod_shape)
        if box is not None:
            assert math.prod(box) == cubes * CUBE_CHIPS and list(box) == sorted(box)
            assert all(side % 4 == 0 and side <= 16 for side in box)
