"""A checkpoint is restored like Orbax restores: the whole state tree is checked
against the plan (names, shapes, dtypes, finite values, step, run state, digests)
and the pod is compared as resolved, before any chip actor is touched. No Ray."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.errors import CheckpointError
from pod.state.checkpoint import checkpoint_path, params_digest, save_checkpoint
from pod.state.resume import initial_checkpoint, resume_checkpoint


def scenario(pod=None, model=None, steps=6, faults=()):
    return parse_scenario({
        "name": "state-checks",
        "pod": pod or {"slice": "v2-8"},
        "model": model or {"name": "mlp", "options": {"hidden": [32], "batch_norm": True}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": steps, "seed": 3,
                     "optimizer": {"name": "adam", "learning_rate": 0.01}},
        "metrics": {"port": 0},
        "faults": list(faults),
    })


@pytest.fixture(scope="module")
def plan():
    return build_plan(scenario())


def valid(plan, step=4, **changes):
    """A checksum-valid checkpoint of ``plan`` at ``step`` (the initial state, relabelled)."""
    ck = initial_checkpoint(plan)
    totals = {"steps": step, "first": {}, "sums": {}, "initial_loss": 2.3, "final_loss": 1.0}
    ck = dataclasses.replace(ck, step=step, run_state={"totals": totals, "faults_done": [],
                                                       "simulated_clock": 0.5})
    ck = dataclasses.replace(ck, **changes)
    if "digests" not in changes:
        ck = dataclasses.replace(ck, digests={"params": params_digest(ck.params),
                                              "optimizer_state": params_digest(ck.optimizer_state)})
    return ck


def resume(tmp_path, plan, ck):
    save_checkpoint(checkpoint_path(tmp_path, 4), ck)
    return resume_checkpoint(tmp_path, plan)


def test_a_valid_checkpoint_resumes(tmp_path, plan):
    path, ck = resume(tmp_path, plan, valid(plan))
    assert ck.step == 4 and path.name == "ckpt-00000004.msgpack"


def test_optimizer_state_of_the_wrong_shape_is_named(tmp_path, plan):
    ck = valid(plan)
    opt = dict(ck.optimizer_state)
    name = next(iter(opt))
    opt[name] = np.zeros((3, 4), np.float32)
    expected = tuple(ck.optimizer_state[name].shape)
    with pytest.raises(CheckpointError) as err:
        resume(tmp_path, plan, valid(plan, optimizer_state=opt))
    assert str(err.value) == (f"--resume {checkpoint_path(tmp_path, 4)}: optimizer_state"
                              f"[{name!r}] has shape (3, 4), expected {expected}")


def test_optimizer_state_holding_nan_is_refused(tmp_path, plan):
    ck = valid(plan)
    opt = {k: v.copy() for k, v in ck.optimizer_state.items()}
    name = list(opt)[-1]
    opt[name].flat[0] = np.nan
    with pytest.raises(CheckpointError, match=rf"optimizer_state\[{name!r}\] holds 1 non-finite"):
        resume(tmp_path, plan, valid(plan, optimizer_state=opt))


def test_parameters_of_the_wrong_shape_fail_before_any_actor(tmp_path, plan):
    ck = valid(plan)
    params = dict(ck.params)
    name = next(iter(params))
    params[name] = np.zeros((2, 2), np.float32)
    with pytest.raises(CheckpointError, match=rf"params\[{name!r}\] has shape \(2, 2\), expected"):
        resume(tmp_path, plan, valid(plan, params=params))


@pytest.mark.parametrize("change, needle", [
    ({"params": "missing"}, r"params lacks '"),
    ({"params": "extra"}, r"params has 'stray'"),
    ({"params": "float64"}, r"has dtype float64, expected float32"),
    ({"model_state": "missing"}, r"model_state lacks"),
    ({"replica_model_state": "short"}, r"replica_model_state has per-chip devices \[2, 2, 2\], "
                                       r"expected 4 chips x 2 devices"),
])
def test_every_tree_is_checked_for_names_and_dtypes(tmp_path, plan, change, needle):
    ck = valid(plan)
    (kind, how), = change.items()
    tree = getattr(ck, kind)
    if how == "missing":
        tree = dict(list(tree.items())[1:])
    elif how == "extra":
        tree = {**tree, "stray": np.zeros(1, np.float32)}
    elif how == "float64":
        tree = {k: v.astype(np.float64) for k, v in tree.items()}
    elif how == "short":
        tree = tree[:3]
    with pytest.raises(CheckpointError, match=needle):
        resume(tmp_path, plan, valid(plan, **{kind: tree}))


def test_the_optimizer_digest_is_compared(tmp_path, plan):
    ck = valid(plan)
    with pytest.raises(CheckpointError, match=r"optimizer_state has SHA-256 .* digest says 000000"):
        resume(tmp_path, plan, valid(plan, digests={"params": ck.digests["params"],
                                                    "optimizer_state": "0" * 64}))
    with pytest.raises(CheckpointError, match=r"params has SHA-256"):
        resume(tmp_path, plan, valid(plan, digests={"params": "1" * 64}))


@pytest.mark.parametrize("changes, needle", [
    ({"step": -1}, r"step is -1, expected 0 to training.steps \(6\)"),
    ({"run_state": {"totals": "x"}}, r"run_state\['totals'\] has str"),
    ({"run_state": [1, 2]}, r"run_state is a list, expected a mapping"),
    ({"run_state": {"simulated_clock": float("nan")}}, r"simulated_clock'\] is nan"),
    ({"run_state": {"faults_done": [7]}}, r"faults_done'\] is \[7\], expected indices of the "
                                          r"scenario's 0 fault"),
    ({"run_state": {"totals": {"steps": 3}}}, r"totals'\]\['steps'\] is 3, expected the "
                                              r"checkpoint's step \(4\)"),
    ({"run_state": {"totals": {"steps": 4, "bogus": 1}}}, r"totals'\] has 'bogus'"),
    ({"run_state": {"junk": 1}}, r"run_state has unknown key\(s\) 'junk'"),
    ({"run_state": {"axis_totals": {"pipe": {"bytes": 1, "seconds": 0, "exposed_seconds": 0}}}},
     r"axis_totals'\] is .*pipe.*, expected per mesh axis \(data, stage, fsdp, expert, tensor\)"),
    ({"run_state": {"axis_totals": {"data": {"bytes": -1, "seconds": 0, "exposed_seconds": 0}}}},
     r"axis_totals'\] is .*finite and >= 0"),
])
def test_step_and_run_state_are_checked(tmp_path, plan, changes, needle):
    with pytest.raises(CheckpointError, match=needle) as err:
        resume(tmp_path, plan, valid(plan, **changes))
    assert "\n" not in str(err.value)


def test_resume_compares_the_resolved_pod(tmp_path, plan):
    written_out = build_plan(scenario(pod={"slice": "v2-8", "topology": "2x2", "chip": "v2",
                                           "chips": 4}))
    ck = valid(plan, scenario=written_out.scenario.model_dump(mode="json"))
    assert resume(tmp_path, plan, ck)[1].step == 4  # the default topology written out is no change


def test_resume_names_the_model_not_the_topology(tmp_path, plan):
    other = build_plan(scenario(pod={"slice": "v2-8", "topology": "2x2"},
                                model={"name": "cnn"}))
    ck = valid(plan, scenario=other.scenario.model_dump(mode="json"))
    with pytest.raises(CheckpointError, match=r": model\.name is 'cnn' in the checkpoint but 'mlp'"):
        resume(tmp_path, plan, ck)


def test_a_really_different_pod_is_named(tmp_path, plan):
    other = build_plan(scenario(pod={"chip": "v2", "chips": 4, "topology": "4"}))
    ck = valid(plan, scenario=other.scenario.model_dump(mode="json"))
    with pytest.raises(CheckpointError, match=r"pod\.slice is None in the checkpoint but 'v2-8'"):
        resume(tmp_path, plan, ck)


def test_a_checkpoint_written_before_a_field_existed_resumes_at_its_default(tmp_path, plan):
    """A scenario field added since the checkpoint (absent from its scenario) is no
    difference while this run keeps the field's default, and one line when it does not."""
    older = plan.scenario.model_dump(mode="json")
    del older["training"]["sequence_parallel"], older["training"]["overlap"]
    assert resume(tmp_path / "a", plan, valid(plan, scenario=older))[1].step == 4
    data = scenario().model_dump(mode="json")
    data["training"]["overlap"] = False  # not the default (true)
    mine = build_plan(parse_scenario(data))
    with pytest.raises(CheckpointError, match=r"training.overlap is None in the checkpoint but "
                                              r"False in the scenario"):
        resume(tmp_path / "b", mine, valid(mine, scenario=older))
