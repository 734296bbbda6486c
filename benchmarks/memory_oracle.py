"""The HBM plan beside XLA's: every committed XLA-oracle result with the project's plan.

The oracle (``tools/xla_oracle``, ``make oracle``) compiles MaxText's train step for a
configuration deviceless for its TPU slice and keeps XLA's memory analysis per device
(``tools/xla_oracle/results/<id>.json``: the scenario and overrides, the mesh, the
per-device batch, the remat policy, ``memory`` {argument, output, alias, temp, peak
bytes}, ``peak_bytes_per_device`` and ``fits``). For each, this plans the same scenario
(``build_plan``, timing-only: the program's ``DeviceMemory`` as ``pod.config.fit``
fits it) and prints XLA's peak beside the plan's total, the difference and both
verdicts, with the plan's items, and XLA's arguments (parameters, optimizer state and
the batch) beside the plan's parameters and optimizer state.

The oracle's ``oracle`` block says what a scenario cannot (yet): a MaxText remat name
the project spells as ``custom`` (``qkv_proj_offloaded``: q, k, v offloaded;
``minimal_offloaded``: every weight matmul's output offloaded;
``save_dot_with_context_except_mlp``: q, k, v, context and out_proj kept), the
parameters' ``weight_dtype`` (when the model has the option). Options with no
bearing on the bytes planned are not mapped (``era``: the MaxText generation, whose
float32 logits XLA fuses into the loss's reductions; ``rename_axes``: fsdp_transpose
shards the same bytes; the flash kernel's block sizes; T5 relative position bias and
QK norm, whose tables are KiBs): the table says which were left out.

Usage::

    python benchmarks/memory_oracle.py              # the table
    python benchmarks/memory_oracle.py --markdown   # VALIDATION.md's "Memory against XLA"
    python benchmarks/memory_oracle.py --json       # rows
    python benchmarks/memory_oracle.py --only T1,T5
    python benchmarks/memory_oracle.py --write      # the table into VALIDATION.md

The fast test ``tests/pod/config/test_memory_oracle.py`` checks every committed result:
the verdicts agree and the totals are within ``TOLERANCE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pod.config.overrides import load_with_overrides  # noqa: E402
from pod.config.plan import build_plan  # noqa: E402
from pod.errors import HBMPlanError, ScenarioError  # noqa: E402
from pod.workloads.remat import REMAT_POLICIES, REMAT_TENSORS  # noqa: E402
from tools.xla_oracle.record import device_peak_bytes  # noqa: E402

RESULTS = ROOT / "tools" / "xla_oracle" / "results"
VALIDATION = ROOT / "VALIDATION.md"
#: VALIDATION.md's region (``tools/validation_figures.py`` checks and rewrites it too)
TABLE_BEGIN = "<!-- generated: memory-oracle -->"
TABLE_END = "<!-- /generated -->"
GIB = 2**30
#: The plan's total against XLA's peak, relative: issue 29's bar.
TOLERANCE = 0.10

#: oracle keys with no bearing on the bytes the plan counts (module docstring)
_NOT_PLANNED = ("era", "rename_axes", "flash_block", "flash_fused_bwd", "relative_position_buckets",
                "qk_norm", "param_scan_axis")


@dataclass(frozen=True)
class Row:
    """One oracle result beside the plan (bytes per device)."""

    id: str
    chip: str
    mesh: str
    per_device_batch: float
    remat: str
    xla_peak_bytes: int | None
    xla_argument_bytes: int
    xla_fits: bool
    plan_bytes: int
    #: None: the plan does not model the configuration (``note`` says why)
    plan_fits: bool | None
    plan_items: dict[str, int]
    plan_state_bytes: int
    left_out: tuple[str, ...]
    note: str = ""

    xla_required_bytes: int | None = None
    #: where XLA's peak is not an HBM figure (``device_peak_bytes``): its device
    #: arguments + temporaries, an upper bound of the HBM peak
    xla_device_bound_bytes: int | None = None

    @property
    def error(self) -> float | None:
        """(plan - XLA) / XLA against XLA's peak; None where XLA refused the program
        (it reports the temporaries it would need, not a peak)."""
        if self.xla_peak_bytes is None or self.plan_fits is None:
            return None
        return (self.plan_bytes - self.xla_peak_bytes) / self.xla_peak_bytes

    @property
    def agrees(self) -> bool:
        """The verdicts agree and, where XLA compiled it, the totals are within
        ``TOLERANCE``."""
        return self.plan_fits is not None and self.plan_fits == self.xla_fits and (
            self.error is None or abs(self.error) <= TOLERANCE)


def oracle_overrides(result: Mapping[str, Any]) -> tuple[list[str], tuple[str, ...]]:
    """The scenario overrides that say what the result's ``oracle`` block says, and the
    oracle keys left out (no bearing on the planned bytes, or not expressible)."""
    oracle = dict(result.get("oracle") or {})
    out = list(result.get("overrides") or [])
    left = [k for k in oracle if k in _NOT_PLANNED]
    remat = oracle.get("remat")
    if remat in REMAT_POLICIES:  # MaxText's names (pod.workloads.remat)
        out.append(f"model.options.remat={remat}")
        custom = {k: v for k, v in dict(oracle.get("remat_custom") or {}).items()
                  if k in REMAT_TENSORS}
        # a named policy's tensors are its own: the scenario's custom choices go
        out.append(f"model.options.remat_custom={json.dumps(custom) if custom else ''}")
    elif remat is not None:
        left.append(f"remat {remat}")
    if "weight_dtype" in oracle:
        out.append(f"model.options.weight_dtype={oracle['weight_dtype']}")
    return out, tuple(left)


def plan_row(result: Mapping[str, Any], root: Path = ROOT) -> Row:
    """The plan of one oracle result's configuration beside XLA's figures.

    A configuration the project does not model (``build_plan``'s ScenarioError: dropless
    routing over an expert axis) is a row with no plan verdict (``plan_fits`` None) and
    the error as its note: it counts as a disagreement, never as a crash.
    """
    overrides, left = oracle_overrides(result)
    # enough examples for one device's share (a tensor group's sequences; a timing-only
    # plan reads shapes only)
    share = result["per_device_batch"] * result["mesh"]["ici"].get("tensor", 1)
    overrides.append(f"data.options.num_examples={int(share * 2) + 16}")
    scenario = load_with_overrides(root / result["scenario"], overrides)
    try:
        plan = build_plan(scenario, timing_only=True)
        memory, fits = plan.device_memory, True
        assert memory is not None
        items, total = dict(memory.rows()), memory.total_bytes
        state = memory.parameters_bytes + memory.optimizer_state_bytes
        note = f"at its {memory.peak}; prefetch {memory.prefetch_layers}"
    except HBMPlanError as err:
        items, total, fits = dict(err.memory_plan), err.requested_bytes, False
        state = items.get("params", 0) + items.get("optimizer_state", 0)
        note = str(err).split("; ", 1)[1] if "; " in str(err) else ""
    except ScenarioError as err:  # not modelled: no verdict
        items, total, fits, state, note = {}, 0, None, 0, f"not planned: {err}"
    memory_xla = result.get("memory") or {}
    oom = (result.get("compile") or {}).get("oom") or {}
    peak = device_peak_bytes(result)
    xla_fits = bool(result["fits"])     # a peak of host memory: fits (record.judge_peak)
    if _compiled_on_host_peak(result):
        note += (f"; XLA's peak {result['peak_bytes_per_device'] / GIB:.2f} GiB is its "
                 f"arguments + {memory_xla['host_temp_bytes'] / GIB:.2f} GiB of host memory: "
                 f"no HBM peak; device arguments + temporaries "
                 f"{result['sum_bytes_per_device'] / GIB:.2f} GiB (an upper bound)")
    return Row(id=result["id"], chip=result["chip"],
               mesh=json.dumps(result["mesh"]["ici"] | {f"dcn {k}": v for k, v in
                                                       result["mesh"].get("dcn", {}).items()}),
               per_device_batch=float(result["per_device_batch"]), remat=str(result["remat"]),
               xla_peak_bytes=None if peak is None else int(peak),
               xla_argument_bytes=int(memory_xla.get("argument_bytes", 0)),
               xla_fits=xla_fits, plan_bytes=int(total), plan_fits=fits,
               plan_items=items, plan_state_bytes=int(state), left_out=left, note=note,
               xla_required_bytes=oom.get("required_bytes"),
               xla_device_bound_bytes=(int(result["sum_bytes_per_device"])
                                       if _compiled_on_host_peak(result) else None))


def _compiled_on_host_peak(data: Mapping[str, Any]) -> bool:
    """XLA compiled the step (its own HBM check passed) but its peak counts host memory."""
    return bool((data.get("compile") or {}).get("ok")) and data.get(
        "peak_bytes_per_device") is not None and device_peak_bytes(data) is None


def load_results(results: Path = RESULTS, only: Iterable[str] | None = None
                 ) -> list[dict[str, Any]]:
    """The committed oracle results with a verdict on HBM (compiled: XLA's peak; refused
    for its HBM: RESOURCE_EXHAUSTED naming HBM), by id; a compile that failed for another
    reason (a kernel's scoped VMEM, a lowering error) says nothing of HBM and is left
    out."""
    wanted = set(only or ())
    out = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if wanted and data["id"] not in wanted:
            continue
        if data.get("fits") is None or (data.get("peak_bytes_per_device") is None
                                        and data["fits"]):
            continue
        error = str((data.get("compile") or {}).get("error") or "")
        if _compiled_on_host_peak(data):
            out.append(data)  # XLA's verdict is its compile's (plan_row)
            continue
        if not data["fits"] and not ("RESOURCE_EXHAUSTED" in error and "HBM" in error):
            continue  # refused for another memory (a kernel's scoped VMEM), or not compiled
        out.append(data)
    return out


def _table(rows: list[Row], markdown: bool) -> str:
    head = ("id", "chip", "mesh", "B/dev", "remat", "XLA GiB", "plan GiB", "error", "XLA",
            "plan", "XLA args GiB", "plan params+opt GiB")
    lines = []
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append("  ".join(f"{h:>10}" for h in head))
    for r in rows:
        xla = (f"{r.xla_peak_bytes / GIB:.2f}" if r.xla_peak_bytes is not None else
               f"(temps {r.xla_required_bytes / GIB:.1f})" if r.xla_required_bytes else
               f"(<= {r.xla_device_bound_bytes / GIB:.2f})" if r.xla_device_bound_bytes else "-")
        cells = (r.id, r.chip, r.mesh.replace('"', ""), f"{r.per_device_batch:g}", r.remat,
                 xla, "-" if r.plan_fits is None else f"{r.plan_bytes / GIB:.2f}",
                 "-" if r.error is None else f"{r.error:+.1%}", "fits" if r.xla_fits else "OOM",
                 {True: "fits", False: "refuses", None: "not planned"}[r.plan_fits],
                 f"{r.xla_argument_bytes / GIB:.2f}" if r.xla_argument_bytes else "-",
                 f"{r.plan_state_bytes / GIB:.2f}")
        lines.append(("| " + " | ".join(cells) + " |") if markdown
                     else "  ".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def write_validation(rows: list[Row], path: Path = VALIDATION) -> None:
    """Replace the table between ``TABLE_BEGIN`` and ``TABLE_END`` of VALIDATION.md with
    the rows' (markdown) and their summary line.

    Raises:
        ValueError: the markers are not in the file.
    """
    text = path.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise ValueError(f"{path.name}: no {TABLE_BEGIN!r} ... {TABLE_END!r} markers")
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    path.write_text(f"{head}{TABLE_BEGIN}\n{validation_body(rows)}{TABLE_END}{tail}")


def validation_body(rows: list[Row]) -> str:
    """VALIDATION.md's region: the command, the Markdown table and its summary line."""
    return ("`python benchmarks/memory_oracle.py --markdown`:\n\n" + _table(rows, markdown=True)
            + "\n\n" + summary(rows) + ".\n")


def summary(rows: list[Row]) -> str:
    """One line: the configurations, the verdicts that agree, the byte errors."""
    sized = [r for r in rows if r.error is not None]
    errors = [abs(r.error) for r in sized if r.error is not None]
    agree = sum(r.plan_fits == r.xla_fits for r in rows)
    text = f"{len(rows)} configurations: verdicts agree on {agree}"
    if errors:
        worst = max(sized, key=lambda r: abs(r.error or 0.0))
        text += (f"; of the {len(sized)} with XLA's HBM peak, |error| mean "
                 f"{sum(errors) / len(errors):.1%}, worst {max(errors):.1%} ({worst.id}), "
                 f"within {TOLERANCE:.0%}: {sum(e <= TOLERANCE for e in errors)}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--items", action="store_true", help="the plan's items per row")
    parser.add_argument("--only", default="", help="comma-separated ids")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="the results folder (default: the committed ones)")
    parser.add_argument("--write", action="store_true",
                        help="write the table between VALIDATION.md's markers")
    args = parser.parse_args(argv)
    results = load_results(args.results, only=[s for s in args.only.split(",") if s])
    rows = [plan_row(r) for r in results]
    if args.write:
        write_validation(rows)
        return 0
    if args.json:
        print(json.dumps([asdict(r) | {"error": r.error} for r in rows], indent=1))
        return 0
    print(_table(rows, args.markdown))
    if args.items:
        for r in rows:
            print(f"{r.id}: " + ", ".join(f"{k.strip()} {v / GIB:.2f}"
                                          for k, v in r.plan_items.items()) + f"  [{r.note}]"
                  + (f"  (left out: {', '.join(r.left_out)})" if r.left_out else ""))
    if rows:
        print("\n" + summary(rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
