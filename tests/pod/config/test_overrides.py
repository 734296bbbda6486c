"""Command-line overrides (``pod.config.overrides``): KEY=VALUE applied to a scenario's
mapping before it is checked, as ``tpu-pod run s.yaml training.steps=10`` does."""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pod
from pod.cli import main
from pod.config.overrides import (REPLACES, Override, apply_overrides, as_overrides, blame,
                                  load_with_overrides, looks_like_override, parse_override,
                                  scenario_with_overrides)
from pod.config.scenario import load_scenario
from pod.errors import ScenarioError

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
LLAMA = ROOT / "scenarios" / "llama-33b-v5p-128.yaml"
BASE = yaml.safe_load(QUICKSTART.read_text())


@pytest.mark.parametrize("text, key, value", [
    ("training.steps=10", "training.steps", 10),
    ("pod.mesh={data: 2, fsdp: 4}", "pod.mesh", {"data": 2, "fsdp": 4}),
    ("pod.slice=v5p-128", "pod.slice", "v5p-128"),
    ("pod.topology='4x4'", "pod.topology", "4x4"),
    ("sweep.remat=[none, full]", "sweep.remat", ["none", "full"]),
    ("training.optimizer.learning_rate=0.5", "training.optimizer.learning_rate", 0.5),
    ("checkpoint=", "checkpoint", None),
    ("faults.0.step=3", "faults.0.step", 3),
    ("description=a=b", "description", "a=b"),  # the first '=' splits
    ("  training.overlap = false", "training.overlap", False),
])
def test_an_override_is_a_dotted_key_and_a_yaml_value(text, key, value):
    override = parse_override(text)
    assert (override.key, override.value) == (key, value)


@pytest.mark.parametrize("text", ["training.steps", "=3", "training..steps=1", ".x=1", "x.=1",
                                  "a b=1", "pod.mesh-size=2", "x" * 5000 + "=1"])
def test_a_malformed_override_is_one_line_with_the_syntax(text):
    with pytest.raises(ScenarioError, match=r"^override '.*': expected KEY=VALUE .*training.steps=10"):
        parse_override(text)


def test_a_value_that_is_not_yaml_names_the_key_and_the_column():
    with pytest.raises(ScenarioError) as err:
        parse_override("pod.mesh={data: 2")
    assert str(err.value).startswith("pod.mesh: invalid YAML value at column ")
    assert str(err.value).endswith("(override pod.mesh={data: 2)")
    with pytest.raises(ScenarioError, match="tag !!python/object.* is not allowed"):
        parse_override("name=!!python/object:os.system x")


def test_dotted_keys_merge_and_whole_values_replace():
    base = {"pod": {"slice": "v5p-128", "mesh": {"fsdp": 16, "tensor": 4}}}
    merged = apply_overrides(base, ["pod.mesh.fsdp=8"])
    assert merged["pod"]["mesh"] == {"fsdp": 8, "tensor": 4}
    replaced = apply_overrides(base, ["pod.mesh={data: 64}"])
    assert replaced["pod"]["mesh"] == {"data": 64}
    created = apply_overrides(base, ["checkpoint.every_steps=5"])
    assert created["checkpoint"] == {"every_steps": 5}
    assert base == {"pod": {"slice": "v5p-128", "mesh": {"fsdp": 16, "tensor": 4}}}  # untouched
    last = apply_overrides(base, ["pod.mesh.fsdp=8", "pod.mesh.fsdp=2"])
    assert last["pod"]["mesh"]["fsdp"] == 2  # the last word wins


def test_a_list_item_is_reached_by_its_index():
    base = {"faults": [{"kind": "kill_chip", "chip": 1, "step": 3}]}
    assert apply_overrides(base, ["faults.0.step=5"])["faults"][0]["step"] == 5
    with pytest.raises(ScenarioError, match=r"^faults: is a list of 1; '1' is not an index of it "
                                            r"\(0 to 0\) \(override faults.1.step=5\)"):
        apply_overrides(base, ["faults.1.step=5"])


def test_a_key_through_a_value_names_the_value():
    with pytest.raises(ScenarioError, match=r"^training.steps: is int 200, not a mapping, so it "
                                            r"has no key 'x' \(override training.steps.x=1\)"):
        apply_overrides(BASE, ["training.steps.x=1"])


@pytest.mark.parametrize("override, dropped, kept", [
    ("training.epochs=2", ["training.steps"], []),
    ("pod.slice=v4-32", ["pod.chip", "pod.chips", "pod.topology"], []),
    ("pod.chips=16", ["pod.slice", "pod.topology"], ["pod.chip"]),
])
def test_keys_that_exclude_one_another_follow_the_override(override, dropped, kept):
    base = {"pod": {"slice": "v4-8", "chip": "v4", "chips": 4, "topology": "2x2x1"},
            "training": {"global_batch": 8, "steps": 3}}
    out = apply_overrides(base, [override])
    for key in dropped:
        section, name = key.split(".")
        assert name not in out[section], key
    for key in kept:
        section, name = key.split(".")
        assert name in out[section], key
    both = apply_overrides(base, ["pod.slice=v4-32", "pod.topology='2x4x2'"])
    assert both["pod"]["topology"] == "2x4x2"  # set by an override too: kept
    assert set(REPLACES) >= {"training.steps", "pod.slice"}


def test_a_file_with_epochs_takes_steps_from_the_command_line():
    scenario = load_with_overrides(ROOT / "scenarios" / "char-lstm.yaml", ["training.steps=4"])
    assert scenario.training.steps == 4 and scenario.training.epochs is None


def test_overrides_are_checked_like_the_file_and_blamed():
    with pytest.raises(ScenarioError) as err:
        load_with_overrides(QUICKSTART, ["training.stepz=3"])
    line = str(err.value)
    assert line.startswith(f"{QUICKSTART}: training.stepz: unknown key (got 3); did you mean steps?")
    assert "allowed: global_batch, steps" in line and line.endswith("(override training.stepz=3)")
    with pytest.raises(ScenarioError, match=r"training.optimizer.learning_rate: must be greater "
                                            r"than 0 \(got -1\).*\(override training.optimizer"):
        load_with_overrides(QUICKSTART, ["training.optimizer.learning_rate=-1"])
    with pytest.raises(ScenarioError, match=r"pod.allreduce: must be one of auto, torus.*"
                                            r"\(got 'best'\).*\(override pod.allreduce=best\)"):
        load_with_overrides(QUICKSTART, ["pod.allreduce=best"])


def test_blame_names_only_the_overrides_of_the_field():
    items = as_overrides(["training.steps=-1", "pod.slice=v3-8"])
    assert blame("f.yaml: training.steps: must be > 0", items) == (
        "f.yaml: training.steps: must be > 0 (override training.steps=-1)")
    assert blame("f.yaml: metrics.port: bad", items) == "f.yaml: metrics.port: bad"
    assert blame("f.yaml: pod: give a slice", items).endswith("(override pod.slice=v3-8)")


def test_the_mapping_form_takes_python_values():
    items = as_overrides({"training.steps": 7, "pod.mesh": {"data": 8}})
    assert [(o.key, o.value) for o in items] == [("training.steps", 7), ("pod.mesh", {"data": 8})]
    with pytest.raises(ScenarioError, match="expected KEY=VALUE"):
        as_overrides({"no good": 1})


def test_looks_like_override_tells_files_from_overrides(tmp_path):
    odd = tmp_path / "a=b.yaml"
    odd.write_text("x")
    assert looks_like_override("training.steps=3") and looks_like_override("training..x=3")
    assert not looks_like_override(str(odd)) and not looks_like_override("s.yaml")
    assert not looks_like_override("scenarios/quickstart.yaml")


def test_the_python_api_takes_overrides():
    plan = pod.validate(str(QUICKSTART), overrides=["training.global_batch=128", "pod.slice=v3-8"])
    assert plan.global_batch == 128 and plan.topology.name == "v3-8"
    spec = pod.load(BASE, overrides={"training.steps": 9})
    assert spec.training.steps == 9
    again = pod.load(spec, overrides=["pod.mesh={data: 4}", "pod.slice=v4-8"])
    assert again.pod.mesh == {"data": 4} and again.training.steps == 9
    text = QUICKSTART.read_text()
    assert pod.load(text, overrides=["training.seed=1"]).training.seed == 1
    with pytest.raises(ScenarioError, match=r"^<dict>: training.seed: .*\(override training.seed=-2\)"):
        pod.load(BASE, overrides=["training.seed=-2"])
    described = pod.describe(str(LLAMA), overrides=["pod.mesh={fsdp: 64}"])
    assert described.plan.mesh.sizes["fsdp"] == 64


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def test_validate_and_describe_take_overrides_on_the_command_line():
    code, out, err = _cli("validate", str(QUICKSTART), "training.steps=10", "pod.slice=v3-8")
    assert code == 0, err
    assert "v3-8, 4 chips, 8 TensorCores" in out and "10 steps" in out
    code, out, err = _cli("validate", str(LLAMA), "pod.mesh.fsdp=8")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {LLAMA}: pod.mesh: {{fsdp: 8, tensor: 4}} has 32 devices")
    assert err.strip().endswith("(override pod.mesh.fsdp=8)")
    code, out, err = _cli("describe", str(LLAMA), "pod.mesh={data: 2, fsdp: 8, tensor: 4}",
                          "--json")
    assert code == 0, err
    assert '"global_batch": 64' in out
    code, _, err = _cli("describe", "v4-8", "training.steps=1")
    assert code == 2 and "overrides belong to a scenario" in err


def test_build_plan_errors_blame_the_override():
    code, _, err = _cli("validate", str(QUICKSTART), "training.global_batch=100")
    assert code == 2
    line = err.strip()
    assert line.startswith(f"error: {QUICKSTART}: training.global_batch: global batch 100 ")
    assert "96 or 104" in line and line.endswith("(override training.global_batch=100)")
    assert len(err.strip().splitlines()) == 1


# -- hypothesis: any key, any value: a scenario or one line naming the override ---------------

_NAMES = st.sampled_from(["pod", "training", "model", "data", "metrics", "sweep", "name", "mesh",
                          "slice", "steps", "options", "global_batch", "optimizer", "x", "faults",
                          "0", "1", "port", "checkpoint", "epochs", "learning_rate", "fsdp"])
_KEYS = st.one_of(
    st.lists(_NAMES, min_size=1, max_size=4).map(".".join),
    st.from_regex(r"\A[a-z_][a-z0-9_]{0,8}(\.[a-z_][a-z0-9_]{0,8}){0,3}\Z"),
)
_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
              st.sampled_from(["v3-8", "v5p-128", "4x4", "sgd", "timing"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(["data", "fsdp", "x", "name"]), inner,
                                            max_size=3)),
    max_leaves=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=_KEYS, value=_VALUES)
def test_any_override_is_a_scenario_or_one_line_naming_it(key, value):
    try:
        scenario = scenario_with_overrides(BASE, {key: value}, source="q.yaml")
    except ScenarioError as err:
        line = str(err)
        assert "\n" not in line
        assert line.startswith(("q.yaml: ", key.split(".")[0])), line
        assert "(override " in line, line
    else:
        assert scenario.name  # valid: the value landed somewhere the schema allows


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_an_override_sets_its_leaf_and_nothing_else(data):
    leaves = _leaves(BASE)
    path, _ = data.draw(st.sampled_from(leaves))
    value = data.draw(_VALUES)
    key = ".".join(str(p) for p in path)
    before = copy.deepcopy(BASE)
    out = apply_overrides(BASE, {key: value})
    assert BASE == before
    assert repr(_at(out, path)) == repr(value)  # repr: a NaN (nested too) equals itself
    dropped = set(REPLACES.get(key, ()))
    for other, old in leaves:
        if other != path and ".".join(map(str, other)) not in dropped:
            assert _at(out, other) == old


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=_KEYS, value=st.sampled_from(["1", "0", "-1", "x", "{data: 2}", "[1, 2]", "null",
                                         "v3-8", "2.5", "true", "'4x4'", "{", "!!binary x"]))
def test_the_cli_gives_a_run_or_one_line_for_any_override(key, value):
    code, out, err = _cli("validate", str(QUICKSTART), f"{key}={value}")
    assert "Traceback" not in err + out
    if code == 0:
        assert ": ok (" in out
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: ")


def _leaves(node: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, (*path, k))]
    return [(path, node)]


def _at(node: Any, path: tuple) -> Any:
    for part in path:
        node = node[part]
    return node


def test_load_scenario_edit_sees_the_resolved_paths(tmp_path):
    path = tmp_path / "s.yaml"
    text = QUICKSTART.read_text().replace("name: digits", "name: mnist\n  path: mnist")
    path.write_text(text)
    seen = {}

    def edit(data: dict) -> dict:
        seen.update(data["data"])
        return apply_overrides(data, ["data.name=digits", "data.path="])

    scenario = load_scenario(path, edit=edit)
    assert seen["path"] == str(tmp_path / "mnist") and scenario.data.path is None
    assert isinstance(Override("a", 1, "a=1").parts, tuple)
