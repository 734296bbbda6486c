"""Terminal tables fit 80 columns in every command (issue 33 item 2): on a terminal too
narrow for a table, columns leave by priority and the rest reads whole (the plan table
showed MFU as '7…' and lost '#', 'remat' and the budget column at 80 columns); ``--wide``
prints every column; piped output is whole."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from rich.console import Console
from rich.table import Table

import pod.cli
import pod.commands.plan
import pod.commands.train
from pod.cli import cli
from pod.report.console import print_table
from tests.pod.report.test_one_figures_record import scenario_data

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "scenarios/transformer-tiny.yaml")
PLAN = ["plan", TINY, "--slice", "v5e-8", "--remat", "none", "--per-device-batch", "2",
        "--mesh-axes", "data,fsdp", "--top", "5"]


@pytest.fixture
def terminal(monkeypatch):
    """Every console of the CLI and of a run is an 80-column terminal writing here."""
    out = io.StringIO()

    def make(file=None):
        return Console(file=out, force_terminal=True, width=80, color_system=None)

    monkeypatch.setattr(pod.cli, "make_console", make)
    monkeypatch.setattr(pod.commands.train, "make_console", make)
    monkeypatch.setattr(pod.commands.plan, "plot_layouts", lambda rows, out, title: out)
    return out


def _tables(text: str) -> list[str]:
    """The lines of tables (box-drawn or a header rule)."""
    return [line for line in text.splitlines()
            if any(c in line for c in "│┃─━") and "\x1b" not in line]  # no progress bar


def _check_fits(text: str) -> None:
    lines = _tables(text)
    assert lines, text
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert not any("…" in line for line in lines), [line for line in lines if "…" in line]


COMMANDS = {
    "run": lambda tmp: ["run", str(tmp / "run.yaml"), "--timing-only", "--output-dir",
                        str(tmp / "out")],
    "describe": lambda tmp: ["describe", str(ROOT / "scenarios/transformer-sharded.yaml"),
                             "--detail"],
    "describe-slice": lambda tmp: ["describe", "v5p-128"],
    "collective": lambda tmp: ["collective", "--slice", "v4-16", "--sizes", "1KiB:4KiB"],
    "plan": lambda tmp: [*PLAN, "--output-dir", str(tmp / "plan")],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_commands_tables_fit_80_columns(terminal, tmp_path, command):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(scenario_data("v5e")))
    args = COMMANDS[command](tmp_path)
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0, (args, out.output[-2000:], out.exception)
    text = terminal.getvalue()
    _check_fits(text)
    if command == "plan":  # the rank, the layout, the step, MFU and the rate stay
        head = next(line for line in text.splitlines() if line.lstrip().startswith("#"))
        for column in ("#", "mesh", "remat", "step", "MFU", "tokens/s"):
            assert column in head.split(), head
        assert "left out to fit 80 columns; --wide shows every column" in " ".join(text.split())


def test_wide_and_piped_tables_are_whole(terminal, tmp_path):
    CliRunner().invoke(cli, [*PLAN, "--wide", "--output-dir", str(tmp_path / "a")])
    wide = terminal.getvalue()
    head = next(line for line in wide.splitlines() if line.lstrip().startswith("#"))
    assert {"compute", "update", "HBM/dev", "bound", "data", "fsdp"} <= set(head.split())
    assert max(len(line) for line in _tables(wide)) > 80 and "left out" not in wide
    # piped: not a terminal, whatever its width
    console = Console(file=io.StringIO(), width=40, force_terminal=False)
    table = Table(*(f"column {i}" for i in range(12)))
    table.add_row(*(f"value {i}" for i in range(12)))
    assert print_table(console, table, drop=("column 3",)) == []
    lines = console.file.getvalue().splitlines()
    assert max(len(line) for line in lines) > 40 and "…" not in console.file.getvalue()
