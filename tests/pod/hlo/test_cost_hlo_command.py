"""``tpu-pod cost-hlo``: any HLO dump costed on a slice; bad input is one line, exit 2."""

from __future__ import annotations

import csv
import gzip
import json

import pytest

from pod.cli import main
from pod.hlo import parse_hlo
from tests.pod.hlo.conftest import DATA, snippet_text


def test_cost_a_committed_tpu_module(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["cost-hlo", str(DATA / "fsdp_block.tpu.hlo.txt.gz"), "--slice", "v5e-8",
              "--mesh", "fsdp=4,tensor=2", "--output-dir", str(tmp_path), "--json"])
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    data = json.loads(out.out)
    assert data["costed_from"] == "TPU-compiled HLO" and data["simulated_step_seconds"] > 0
    assert set(data["collectives_by_lane"]) >= {"fsdp", "tensor"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "collectives.csv", "layers.csv", "summary.json", "trace.json.gz"]
    # layers.csv names the user's code: each row's source and call chain are those the
    # module's tables give one of its instructions of that op name
    with open(tmp_path / "layers.csv", newline="") as f:
        rows = list(csv.DictReader(row for row in f if not row.startswith("#")))
    assert list(rows[0])[:3] == ["op_name", "source", "call_chain"]
    module = parse_hlo(snippet_text("fsdp_block", "tpu"))
    where: dict[str, set] = {}
    for _, instr in module.instructions():
        where.setdefault(instr.op_name, set()).add(
            (module.source_of(instr), module.call_chain_of(instr)))
    for row in rows:
        if not row["op_name"].startswith("("):  # "(opcode name)": an op XLA left unnamed
            assert (row["source"], row["call_chain"]) in where[row["op_name"]], row
        # every frame of this module is the user's: the source is the chain's innermost
        if row["call_chain"]:
            assert row["source"].endswith(f" ({row['call_chain'].split(' > ')[-1]})"), row
    chains = {row["call_chain"] for row in rows}
    assert ("_steps.<locals>.fsdp_step > _steps.<locals>.fsdp_step.<locals>.loss > "
            "_steps.<locals>.block") in chains
    # the trace's kernels carry the same: each op event's op name, source and chain are
    # its instruction's as the module gives them
    with gzip.open(tmp_path / "trace.json.gz", "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "op"]
    named = [e for e in events if "call_chain" in e["args"]]
    assert len(named) > len(events) / 2
    by_name = {instr.name: instr for _, instr in module.instructions()}
    for event in named:
        instr = by_name[event["name"].rsplit(" [", 1)[1].rstrip("]")]
        assert (event["args"]["op_name"], event["args"]["source"],
                event["args"]["call_chain"]) == (instr.op_name, module.source_of(instr),
                                                 module.call_chain_of(instr)), event


def test_a_cpu_module_is_labelled_approximate(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["cost-hlo", str(DATA / "mlp_scan.cpu.hlo.txt.gz"), "--slice", "v5e-8",
              "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "approximate (CPU-compiled HLO)" in out


@pytest.mark.parametrize("text, args, needle", [
    ("HloModule m\nENTRY %e {\n  %x = f32[2 parameter(0)\n}\n", [], "line 3: x:"),
    ("not hlo at all\n", [], "line 1: expected a computation header"),
    (None, ["--slice", "v5e-7"], "slice: slice 'v5e-7' does not exist"),
    (None, ["--slice", "v5p-128"], "the module runs on 8 devices but v5p-128 has 64"),
    (None, ["--slice", "v5e-8", "--mesh", "fsdp"], "--mesh 'fsdp' is not a mesh"),
])
def test_bad_input_is_one_line(tmp_path, capsys, text, args, needle):
    path = DATA / "mlp_scan.tpu.hlo.txt.gz"
    if text is not None:
        path = tmp_path / "bad.txt"
        path.write_text(text)
    with pytest.raises(SystemExit) as done:
        main(["cost-hlo", str(path), *(args or ["--slice", "v5e-8"]), "--output-dir",
              str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and needle in err, err
    if text is not None and needle.startswith("line "):   # the file it came from, first
        assert err.startswith(f"error: {path}: {needle}"), err
