"""What ``tpu-pod plan`` prints: the search in one line, the best points as a table with
their step breakdown (simulated), the best of each mesh family, the summary line."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from pod.commands.plan import PlanResult, layout_label
from pod.commands.plan_search import capacity_text, compared_batch, family
from pod.commands.sweep import is_missing, json_row
from pod.config.mesh import AXIS_NAMES
from pod.report.console import titled_table

__all__ = ["search_line", "plan_table", "family_lines", "family_title", "family_batch",
           "plan_json", "family", "tokens_text", "plan_progress"]

_GIB = 2**30


@contextlib.contextmanager
def plan_progress(console: Console | None = None
                  ) -> Iterator[Callable[[dict[str, Any], int], None]]:
    """A progress bar while ``run_plan`` runs (its ``on_point``): points done of all, how
    many costed, the best so far. On a terminal, or in a notebook when ipywidgets is
    installed (rich's Jupyter display needs it); nothing when the output is piped.

    Yields:
        The ``on_point`` callback.
    """
    console = console or Console(stderr=True)
    shown = console.is_terminal or (console.is_jupyter and _has_ipywidgets())
    state: dict[str, Any] = {"costed": 0, "rate": 0.0, "unit": "", "best": ""}
    with Progress(TextColumn("[bold]plan"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console,
                  transient=True, disable=not shown) as progress:
        task = progress.add_task("plan", total=None, status="")

        def on_point(row: dict[str, Any], total: int) -> None:
            if row["status"] == "ok":
                state["costed"] += 1
                tokens = not is_missing(row["simulated_tokens_per_second"])
                rate = row["simulated_tokens_per_second" if tokens
                           else "simulated_examples_per_second"]
                if rate > state["rate"]:
                    state.update(rate=rate, unit="tokens/s" if tokens else "examples/s",
                                 best=f"{row['mesh']} {row['remat'] or ''}".strip())
            best = (f", best {state['rate']:,.0f} {state['unit']} ({state['best']})"
                    if state["rate"] else "")
            progress.update(task, total=total, advance=1,
                            status=f"{state['costed']:,} costed{best}")

        yield on_point


def _has_ipywidgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def search_line(result: PlanResult) -> str:
    """``llama2-7b on v5e-256: 4,096-token sequences, 1,024 per step (4,194,304 tokens);
    meshes over data, fsdp, tensor; remat none, minimal, full``."""
    length = result.sequence_length
    if result.global_batch is not None:
        tokens = f" ({result.global_batch * length:,} tokens)" if length else ""
        batch = f"{result.global_batch:,} per step{tokens}"
    else:
        batch = f"{', '.join(map(str, result.per_device_batches))} per device"
    what = f"{length:,}-token sequences, " if length else "examples, "
    remat = f"; remat {', '.join(result.remats)}" if any(result.remats) else ""
    budget = (f"; ranked by the simulated time to {tokens_text(result.token_budget)} tokens"
              if result.token_budget else "")
    slices = (f" x {', '.join(map(str, result.num_slices))} slices (data parallel across them, "
              "over the DCN)" if result.multislice else "")
    capacity = ""
    if any(c is not None for c in result.capacities):
        capacity = f"; experts {', '.join(capacity_text(c) for c in result.capacities)}"
        if 0.0 in result.capacities and "expert" in result.axes:
            capacity += " (dropless only with expert 1: its all-to-all is ragged, not modelled)"
    fixed = ", ".join(f"{a} {n}" for a, n in result.fixed.items())
    fixed = f" with {fixed} (ici_*_parallelism)" if fixed else ""
    return (f"{result.name} on {', '.join(result.slices)}{slices}: {what}{batch}; meshes over "
            f"{', '.join(result.axes)}{fixed}{remat}{capacity}{budget}")


def tokens_text(count: int) -> str:
    """A token count as people say it: ``2T``, ``1.5B``, ``4M``, ``4,096``."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6)):
        if count >= size:
            return f"{count / size:,.3g}{unit}"
    return f"{count:,}"


def _ms(seconds: float) -> str:
    """Seconds as milliseconds: ``5,353``, ``26.7``, ``0.012``, ``0``."""
    if is_missing(seconds):
        return ""
    ms = seconds * 1e3
    return ("0" if ms == 0 else f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1
            else f"{ms:.3f}")


def _duration(seconds: float) -> str:
    """Simulated seconds as days / hours / minutes: ``3.2 d``, ``5.1 h``, ``42 min``."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:,.1f} s"


def plan_table(result: PlanResult, top: int = 10) -> Table:
    """The ``top`` best points: layout, simulated step breakdown (compute, exposed
    collectives per searched mesh axis, update), HBM per device, MFU, rate, bound. A plan
    over several slices adds their number, the mesh across them (``{data: 2} x {fsdp:
    8}``: across slices x within one) and the DCN's share of the collectives."""
    rows = result.ranked[:top]
    tokens = result.sequence_length > 0
    many = len(result.slices) > 1
    multi = result.multislice
    searched = (*result.axes, "data") if multi else result.axes  # data: across the slices
    axes = [a for a in AXIS_NAMES if a in searched and any(r[a] > 1 for r in rows)]
    caption = (f"ms per step, simulated; {' / '.join(axes)}: the collectives of the mesh axis "
               "that compute does not hide; batch: per device (global)" if axes else None)
    if caption and any(r["stage"] > 1 for r in rows):
        caption += "; bubble: the pipeline's (its stages waiting for each other)"
    if multi and caption:
        caption += ("; mesh: across slices (DCN) x within a slice (ICI); dcn: the collectives' "
                    "time on the DCN (part of data's, hidden or not)")
    pruned = result.count("pruned")
    of = (f"{result.count('ok') + pruned:,} layouts that plan ({result.count('ok'):,} costed, "
          f"{pruned:,} slower by their compute alone)" if pruned
          else f"{result.count('ok'):,} costed layouts")
    table = titled_table(f"The {len(rows)} fastest of {of}",
                         caption=caption, box=box.SIMPLE_HEAD, pad_edge=False)
    moe = any(c is not None for c in result.capacities)
    pipelined = any(r["stage"] > 1 for r in rows)
    head = ["#", *(["slice"] if many else []), *(["slices"] if multi else []), "mesh", "remat",
            *(["experts"] if moe else []), "batch", "step", "compute",
            *(["bubble"] if pipelined else []), *axes, *(["dcn"] if multi else []), "update",
            "HBM/dev", "MFU",
            "tokens/s" if tokens else "examples/s",
            *([f"to {tokens_text(result.token_budget)}"] if result.token_budget else []),
            "bound"]
    for name in head:
        left = name in ("slice", "mesh", "remat", "experts", "bound")
        table.add_column(name, justify="left" if left else "right", no_wrap=True)
    for r in rows:
        rate = r["simulated_tokens_per_second"] if tokens else r["simulated_examples_per_second"]
        table.add_row(
            str(r["rank"]), *([r["slice"]] if many else []), *([str(r["slices"])] if multi else []),
            layout_label(r, False), r["remat"] or "-",
            *([_capacity(r)] if moe else []),
            f"{r['per_device_batch']:,} ({r['global_batch']:,})", _ms(r["simulated_step_seconds"]),
            _ms(r["compute_seconds"]),
            *([_ms(r["pipeline_bubble_seconds"])] if pipelined else []),
            *(_ms(r[f"exposed_{a}_seconds"]) for a in axes),
            *([_ms(r["dcn_collective_seconds"])] if multi else []), _ms(r["update_seconds"]),
            f"{r['hbm_per_device_bytes'] / _GIB:.1f} GiB",
            f"{r['mfu']:.1%}", f"{rate:,.0f}",
            *([_duration(r["simulated_seconds_to_budget"])] if result.token_budget else []),
            f"{r['bound']} {r['bound_fraction']:.0%}")
    return table


def family_batch(result: PlanResult) -> int | None:
    """The global batch the mesh families are compared at (``plan_search.compared_batch``
    of the points that run), None when none runs."""
    return compared_batch(result.rows, result.axes)


def family_lines(result: PlanResult) -> list[str]:
    """The best point of each mesh family (``fsdp``, ``fsdp+tensor``, ...) at one global
    batch (``family_batch``: families compared on the same work per step), best first;
    nothing when every costed point there is of one family."""
    batch = family_batch(result)
    best: dict[str, dict[str, Any]] = {}
    for r in result.ranked:
        if r["global_batch"] == batch:
            best.setdefault(family(r, result.axes), r)
    if len(best) < 2:
        return []
    rate = "tokens/s" if result.sequence_length else "examples/s"
    key = "simulated_tokens_per_second" if result.sequence_length else \
        "simulated_examples_per_second"
    width = max(18, *(len(name) for name in best))  # stage families are longer than 18
    return [f"  {name:<{width}} #{r['rank']:<4} MFU {r['mfu']:.1%}, {r[key]:,.0f} {rate}: "
            f"{_where(r)} remat {r['remat'] or '-'}{_experts(r)}, {r['per_device_batch']:,} "
            "per device" for name, r in best.items()]


def family_title(result: PlanResult) -> str:
    """``Best of each mesh family at 1,024 sequences per step (the most families run
    it):``."""
    batch = family_batch(result) or 0
    what = "sequences" if result.sequence_length else "examples"
    how = ("the global batch asked" if result.global_batch is not None
           else "the largest batch the most families run")
    return f"Best of each mesh family at {batch:,} {what} per step ({how}):"


def _capacity(row: dict[str, Any]) -> str:
    """A mixture of experts' routing: ``dropless``, ``cf 1.25``; "-" for a dense model."""
    c = row.get("capacity_factor")
    return "-" if is_missing(c) else ("dropless" if c == 0 else f"cf {c:g}")


def _experts(row: dict[str, Any]) -> str:
    """``, experts capacity 1.25`` (a mixture of experts), "" otherwise."""
    c = row.get("capacity_factor")
    return "" if is_missing(c) else f", experts {capacity_text(c)}"


def _where(row: dict[str, Any]) -> str:
    """``v5e-256 {fsdp: 256}``; ``2 x v5e-256 {fsdp: 256}`` over 2 slices (data across)."""
    slices = row.get("slices", 1)
    return f"{slices} x {row['slice']} {row['mesh']}" if slices > 1 else \
        f"{row['slice']} {row['mesh']}"


def plan_json(result: PlanResult) -> dict[str, Any]:
    """The plan as one JSON document: what was searched, the counts, every row (ranked;
    a missing number is null)."""
    return {"model": result.name, "slices": list(result.slices),
            "num_slices": list(result.num_slices), "axes": list(result.axes),
            "remat": [r for r in result.remats if r], "sequence_length": result.sequence_length,
            "global_batch": result.global_batch,
            "per_device_batches": list(result.per_device_batches),
            "token_budget": result.token_budget, "points": len(result.rows),
            "costed": result.count("ok"), "pruned": result.count("pruned"),
            "dropped": result.count("dropped"),
            "failed": result.count("failed"), "wall_seconds": result.wall_seconds,
            "rows": [json_row(r) for r in result.rows]}
