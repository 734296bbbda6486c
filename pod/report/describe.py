"""What ``tpu-pod describe`` prints: a pod's table, one device's HBM plan, and the one
timing-only step (``pod.api.describe``) as a record and as a line of its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from pod.report.console import titled_table

if TYPE_CHECKING:
    from pod.config.slices import Topology
    from pod.report.bounds import StepBounds
    from pod.report.stats import StepStats

__all__ = ["pod_table", "pod_json", "memory_table", "step_record", "step_line"]


def pod_table(pod: Topology) -> Table:
    """A pod's figures per chip and for the pod, as a table."""
    chip = pod.chip
    core = chip.core
    published = ""
    if chip.published_peak_bf16_flops_per_s:
        published = (f" (Google: {pod.chips * chip.published_peak_bf16_flops_per_s / 1e12:,.0f}"
                     f" TFLOP/s)")
    table = titled_table(f"{pod.name}: {pod.chips:,} chips, {pod.tensorcores} TensorCores, "
                        f"{pod.peak_bf16_flops_per_s / 1e12:,.0f} TFLOP/s bf16{published}, "
                        f"{pod.hbm_bytes / 2**30:,.0f} GiB HBM")
    table.add_column("figure")
    table.add_column("per chip", justify="right")
    table.add_column("pod", justify="right")
    table.add_row("TensorCores", f"{chip.tensorcores}", f"{pod.tensorcores}")
    table.add_row("MXUs per core", f"{core.mxus_per_core} x {core.mxu.rows}x{core.mxu.cols}", "")
    table.add_row("clock", f"{core.clock_hz / 1e6:,.0f} MHz", "")
    table.add_row("peak bf16", f"{chip.peak_bf16_flops_per_s / 1e12:,.1f} TFLOP/s",
                  f"{pod.peak_bf16_flops_per_s / 1e12:,.1f} TFLOP/s")
    table.add_row("HBM (published)" if chip.hbm_available_bytes != chip.hbm_bytes else "HBM",
                  f"{chip.hbm_bytes / 2**30:,.1f} GiB", f"{pod.hbm_bytes / 2**30:,.1f} GiB")
    if chip.hbm_available_bytes != chip.hbm_bytes:  # XLA's figure: what decides a fit
        table.add_row("HBM a program may use (XLA)", f"{chip.hbm_available_bytes / 2**30:,.2f} GiB",
                      f"{pod.chips * chip.hbm_available_bytes / 2**30:,.1f} GiB")
    table.add_row("HBM bandwidth", f"{chip.hbm_bandwidth_bytes_per_s / 1e9:,.0f} GB/s", "")
    table.add_row("ICI", f"{chip.ici_links} links x "
                         f"{chip.ici_link_bandwidth_bytes_per_s / 1e9:,.0f} GB/s one way",
                         f"{pod.torus.name} (wraparound "
                         f"{'/'.join('y' if w else 'n' for w in pod.torus.wraparound)})")
    if pod.slices > 1:  # multislice: the data-centre network between the slices
        table.add_row("DCN", f"{chip.dcn_bytes_per_s / 1e9:,.2f} GB/s one way (a host's "
                             f"{chip.chips_per_host} chips share "
                             f"{chip.chips_per_host * chip.dcn_bytes_per_s / 1e9:,.1f})",
                      f"{pod.slices} slices of {pod.torus.num_chips:,} chips")
    return table


def pod_json(pod: Topology) -> dict[str, Any]:
    """A pod's figures as plain data (``describe --json``'s ``pod``)."""
    chip = pod.chip
    return {"name": pod.name, "generation": chip.name, "chips": pod.chips,
            "tensorcores": pod.tensorcores, "topology": pod.torus.name,
            "wraparound": list(pod.torus.wraparound),
            "peak_bf16_flops_per_s": pod.peak_bf16_flops_per_s, "hbm_bytes": pod.hbm_bytes,
            "hbm_available_bytes_per_chip": chip.hbm_available_bytes,
            "hbm_bandwidth_bytes_per_s_per_chip": chip.hbm_bandwidth_bytes_per_s,
            "ici_links_per_chip": chip.ici_links,
            "ici_link_bandwidth_bytes_per_s": chip.ici_link_bandwidth_bytes_per_s,
            "slices": pod.slices, "dcn_bytes_per_s_per_chip": chip.dcn_bytes_per_s}


def memory_table(title: str, memory: dict[str, int], cap: int) -> Table:
    """The HBM plan of one device as a table."""
    table = titled_table(title)
    table.add_column("item")
    table.add_column("bytes", justify="right")
    table.add_column("MiB", justify="right")
    for item, nbytes in memory.items():
        table.add_row(item, f"{nbytes:,}", f"{nbytes / 2**20:.3f}")
    table.add_row("capacity", f"{cap:,}", f"{cap / 2**20:.0f}")
    return table


def step_record(stats: StepStats | None, bounds: StepBounds | None) -> dict[str, Any] | None:
    """``describe --json``'s ``step``: a timing-only step's simulated figures (its
    ``StepStats`` properties) and what bounds it; None when none ran."""
    if stats is None or bounds is None:
        return None
    return {"simulated_step_seconds": stats.step_seconds, "compute_seconds": stats.compute_seconds,
            "exposed_collective_seconds": stats.exposed_collective_seconds,
            "exposed_by_axis": dict(stats.axis_exposed_seconds),
            "collective_by_axis": dict(stats.axis_collective_seconds),
            "dcn_by_axis": dict(stats.axis_dcn_seconds),
            "pipeline_bubble_seconds": stats.pipeline_bubble_seconds,
            "exposed_host_offload_seconds": stats.exposed_host_offload_seconds,
            "exposed_infeed_seconds": stats.exposed_infeed_seconds,
            "dispatch_seconds": stats.dispatch_seconds,
            "update_seconds": stats.update_seconds, "mfu": stats.mfu, "hfu": stats.hfu,
            "simulated_examples_per_second": stats.examples_per_second,
            "simulated_tokens_per_second": stats.tokens_per_second,
            "bound": bounds.label, "bound_fraction": bounds.fraction}


def step_line(step: dict[str, Any]) -> str:
    """``step_record``'s step as a sum of its critical path's parts (every nonzero one)."""
    axes = ", ".join(f"{a} {s * 1e3:.3f} ms" for a, s in step["exposed_by_axis"].items() if s)
    parts = [("compute", step["compute_seconds"], ""),
             ("exposed collectives", step["exposed_collective_seconds"],
              f" ({axes})" if axes else ""),
             ("exposed host offload", step["exposed_host_offload_seconds"], ""),
             ("pipeline bubble", step["pipeline_bubble_seconds"], ""),
             ("exposed infeed", step["exposed_infeed_seconds"], ""),
             ("dispatch", step["dispatch_seconds"], ""), ("update", step["update_seconds"], "")]
    total = " + ".join(f"{name} {s * 1e3:.3f}{note}" for name, s, note in parts
                       if s or name in ("compute", "exposed collectives", "update"))
    rate = (f"{step['simulated_tokens_per_second']:,.0f} tokens/s"
            if step["simulated_tokens_per_second"] else
            f"{step['simulated_examples_per_second']:,.0f} examples/s")
    dcn = "".join(f"; DCN: {s * 1e3:.3f} ms of the {a} axis's "
                  f"{step['collective_by_axis'].get(a, 0.0) * 1e3:.3f} ms of collectives"
                  for a, s in step.get("dcn_by_axis", {}).items())
    return (f"step (simulated, timing-only): {step['simulated_step_seconds'] * 1e3:.3f} ms = "
            f"{total}; {rate}, MFU {step['mfu']:.1%}; bound "
            f"{step['bound']} {step['bound_fraction']:.0%}{dcn}")
