"""``report.html``: one self-contained page per run, for people to look at.

The page holds the summary table (each figure with its clock), the model
summary (per layer: shapes, parameters, FLOPs, HBM bytes, simulated time of
one training step on one TensorCore), the loss and the simulated step-time
breakdown per step (inline SVG drawn by matplotlib, the ``[plots]`` extra;
without it the page says so) and the HBM plan per TensorCore (per device on a
sharded mesh). Nothing is
loaded from the network: the file opens offline and can be mailed.
"""

from __future__ import annotations

import html
import io
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from pod.report.console import summary_rows
from pod.report.files import steps_rows, write_atomic

__all__ = ["render_report", "write_report", "read_steps"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; white-space: nowrap; }
th { background: #eef; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
td.pre { white-space: pre; }
div.wide { overflow-x: auto; max-width: 100%; }
p.note { color: #555; }
"""

def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: set[int],
           pre: Collection[int] = ()) -> str:
    """An HTML table in a box that scrolls sideways when it is wider than the page.

    Args:
        headers: the column names.
        rows: the cells, as text.
        numeric: columns aligned right (numbers).
        pre: columns whose leading spaces are kept (``white-space: pre``): the summary's
            indented parts ("  compute", "    fsdp").
    """
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(
            f"<td{' class=n' if i in numeric else ' class=pre' if i in pre else ''}>"
            f"{html.escape(str(v))}</td>" for i, v in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    return (f'<div class="wide"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def read_steps(path: Path) -> list[dict[str, float]]:
    """steps.csv's rows with numbers as floats (empty cells dropped), up to its first
    damaged line (``pod.report.files.steps_rows``)."""
    return [{k: float(v) for k, v in row.items() if v not in ("", "True", "False")}
            for _, row in steps_rows(Path(path))]


def _plots_svg(steps: Sequence[Mapping[str, float]]) -> str:
    """Loss and the simulated step-time parts per step, as inline SVG (matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return ('<p class="note">The plots need matplotlib: pip install '
                "'tpu-pod-emulator[plots]'.</p>")
    from pod.report.figures import subplots  # no pyplot: a notebook's backend stays

    x = [s["step"] for s in steps]
    fig, (left, right) = subplots(1, 2, figsize=(11, 3.8))
    left.plot(x, [s["loss"] for s in steps], label="training loss")
    tested = [s for s in steps if "test_loss" in s]
    if tested:
        left.plot([s["step"] for s in tested], [s["test_loss"] for s in tested], "o-",
                  label="test loss")
    left.set(xlabel="step", ylabel="loss", title="loss")
    left.legend(fontsize=8)
    parts = ("exposed_infeed_seconds", "compute_seconds", "exposed_collective_seconds",
             "pipeline_bubble_seconds", "update_seconds")
    right.stackplot(x, *[[s.get(p, 0.0) * 1e3 for s in steps] for p in parts],
                    labels=[p.replace("_seconds", "").replace("_", " ") for p in parts])
    right.set(xlabel="step", ylabel="ms (simulated)", title="step time, critical path (simulated)")
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # drop the XML prologue: inline in HTML


def render_report(summary: Mapping[str, Any], steps: Sequence[Mapping[str, float]],
                  layers: Sequence[Mapping[str, Any]], memory: Mapping[str, int],
                  hbm_capacity_bytes: int) -> str:
    """The report page as a string.

    Args:
        summary: the run's summary (summary.json).
        steps: steps.csv's rows (``read_steps``).
        layers: layers.csv's rows (``pod.report.model_summary.layer_rows``).
        memory: the HBM plan of one TensorCore (of one device on a sharded
            mesh), bytes per item and ``total``.
        hbm_capacity_bytes: one TensorCore's (device's) HBM capacity.
    """
    title = (f"{summary['scenario']}: {summary.get('slice') or summary['generation']} "
             f"({summary['chips']:,} chips, {summary['cores']:,} TensorCores, "
             f"{summary['topology']})")
    data = summary["dataset"] + (" (synthetic)" if summary.get("synthetic_data") else "")
    figures = _table(("figure", "value", "clock"), summary_rows(dict(summary)), {1}, pre={0})
    mesh = summary.get("mesh") or {}
    per = "device"
    split = f"device of the mesh {{{', '.join(f'{a}: {n}' for a, n in mesh.items())}}}"
    model = _table(("layer (type)", "input shape", "output shape", "params", "FLOPs / step",
                    "HBM bytes / step", "sim time / step (us)", "MXU us", "vector unit us"),
                   [(f"{r['layer']} ({r['type']})", r["input_shape"], r["output_shape"],
                     f"{r['parameters']:,}", f"{r['flops']:,}", f"{r['hbm_bytes']:,}",
                     f"{r['simulated_seconds'] * 1e6:,.2f}",
                     f"{r['simulated_mxu_seconds'] * 1e6:,.2f}",
                     f"{r['simulated_vpu_seconds'] * 1e6:,.2f}") for r in layers],
                   {3, 4, 5, 6, 7, 8})
    hbm = _table(("item", "bytes", "MiB"),
                 [(item, f"{n:,}", f"{n / 2**20:,.3f}") for item, n in memory.items()]
                 + [("capacity", f"{hbm_capacity_bytes:,}", f"{hbm_capacity_bytes / 2**20:,.0f}")],
                 {1, 2})
    plots = _plots_svg(steps) if steps else '<p class="note">No steps recorded.</p>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(summary['scenario'])} - tpu-pod run report</title>
<style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(summary['model'])} ({summary.get('parameters', 0):,} parameters) on
{html.escape(data)}; global batch {summary['global_batch']:,} = {summary["per_device_batch"]:,}
per {html.escape(split)}; {summary['steps']:,} steps. Figures are <b>simulated</b> \
(what the TPU pod would
take) or <b>wall</b> (what the emulation took here), as marked.</p>
<h2>Summary</h2>
{figures}
<h2>Loss and step time</h2>
{plots}
<h2>Model (one training step on one TensorCore, simulated)</h2>
{model}
<h2>HBM plan per {per}</h2>
{hbm}
</body></html>
"""


def write_report(path: Path, summary: Mapping[str, Any], steps: Sequence[Mapping[str, float]],
                 layers: Sequence[Mapping[str, Any]], memory: Mapping[str, int],
                 hbm_capacity_bytes: int) -> Path:
    """Write ``render_report``'s page to ``path`` atomically; returns the path.

    Raises:
        OutputError: the file system refused; one line naming the path.
    """
    text = render_report(summary, steps, layers, memory, hbm_capacity_bytes)
    write_atomic(Path(path), lambda f: f.write(text))
    return Path(path)
