"""Tables people read (issue 25, item 8): the model, per-part and sharding tables at 80
columns (a compact form, no cell cut or wrapped letter by letter), the wide form where
there is room; report.html keeps the summary's indentation and its tables fit the
page (a box that scrolls sideways)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

import pod
from pod.report.model_summary import plan_model_tables

ROOT = Path(__file__).resolve().parents[3]
SCENARIOS = ["quickstart.yaml", "transformer-sharded.yaml", "resnet50-weak-v3-v4.yaml",
             "llama-33b-v5p-128.yaml"]


def _render(plan, width: int, detail: bool = False) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    for table in plan_model_tables(plan, detail=detail):
        console.print(table)
    return console.export_text()


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_model_tables_read_at_80_columns(name):
    plan = pod.validate(ROOT / "scenarios" / name, sharded_ok=True)
    text = _render(plan, 80, detail=name == "transformer-sharded.yaml")
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text  # no cell cut short
    rows = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    for layer in plan.model.layers:  # every layer's name whole, on one line
        assert layer.name in rows, layer.name
    assert "FLOPs / step" not in text and "sim us / step" in text


def test_the_wide_form_where_there_is_room():
    plan = pod.validate(ROOT / "scenarios/transformer-sharded.yaml", sharded_ok=True)
    text = _render(plan, 200)
    assert "layer (type)" in text and "FLOPs / step" in text and "fsdp chunk / device" in text
    assert "block1 (transformer_block)" in text


def test_report_html_keeps_the_indentation_and_fits(tmp_path):
    scenario = {"name": "html", "pod": {"slice": "v5e-8", "mesh": {"data": 2, "fsdp": 2,
                                                                   "tensor": 2}},
                "model": {"name": "transformer",
                          "options": {"embed_dim": 32, "heads": 2, "layers": 1}},
                "data": {"name": "text", "options": {"sequence_length": 16}},
                "training": {"global_batch": 8, "steps": 2}, "metrics": {"port": 0}}
    pod.run(scenario, in_process=True, quiet=True, output_dir=tmp_path, report=True)
    page = (tmp_path / "report.html").read_text()
    assert re.search(r"td\.pre\s*\{\s*white-space:\s*pre;", page)
    for axis in ("data", "fsdp", "tensor"):  # the per-axis rows, indented under collectives
        assert f"<td class=pre>    {axis}</td>" in page, axis
    assert "<td class=pre>  compute (fwd+bwd)</td>" in page
    tables = page.count("<table>")
    assert tables == page.count('<div class="wide"><table>') >= 3
    assert re.search(r"div\.wide\s*\{\s*overflow-x:\s*auto;", page)
