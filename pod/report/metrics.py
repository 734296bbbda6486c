"""Prometheus exporter for a running pod, on its own ``CollectorRegistry``.

A gauge of the last step (MFU, loss, throughput, ...) is absent until the
first step, not 0, so that alert rules on it (``TpuPodLowMFU``) do not fire
while the pod starts; the test accuracy is absent until the first evaluation.

Names follow Prometheus conventions (``tpu_pod_`` prefix, base units,
``_total`` for counters); the clock is in the name: ``simulated`` figures come
from the cost models, ``wall`` figures from this host. Labels are bounded:
``chip`` (a rank), ``core`` (the TensorCore of a device: 0 on chips of one
device), ``link``, ``axis`` (a mesh axis), ``expert`` (an expert index, at most
``MAX_EXPERT_LABELS`` of them, the rest as "other") and the run-info labels,
never a step number. The chip generation is ``tpu_pod_info``'s ``generation`` label, so
``chip`` means one thing everywhere.

| metric | type | labels | meaning |
|---|---|---|---|
| tpu_pod_info | gauge (1) | scenario, generation, slice, topology, dataset, synthetic | what is running |
| tpu_pod_steps_total | counter | | training steps done |
| tpu_pod_examples_total | counter | | training examples processed |
| tpu_pod_simulated_step_seconds | histogram | | simulated step time (buckets 2.2% apart around the first step: ``simulated_buckets``) |
| tpu_pod_simulated_step_part_seconds | gauge | part | last step: infeed, compute, collective, update, and exposed_infeed, exposed_collective, dispatch (the critical path's parts) |
| tpu_pod_collective_overlap_ratio | gauge | | share of the collectives hidden behind the compute, last step |
| tpu_pod_simulated_examples_per_second | gauge | | last step's simulated throughput |
| tpu_pod_simulated_tokens_per_second | gauge | | last step's simulated tokens/s (sequence models) |
| tpu_pod_simulated_flops_per_second | gauge | | last step's model FLOP/s (simulated) |
| tpu_pod_mfu_ratio | gauge | | model FLOPs utilisation, 0..1 |
| tpu_pod_simulated_tflops_per_device | gauge | | TFLOP/s per device as MaxText prints it (transformers) |
| tpu_pod_loss | gauge | | last step's training loss |
| tpu_pod_test_accuracy_ratio | gauge | | last evaluated test accuracy |
| tpu_pod_mxu_utilization_ratio | gauge | chip, core | MXU FLOPs / (device peak x step time), last step |
| tpu_pod_simulated_chip_compute_seconds | gauge | chip | the chip's forward + backward (slowest device), last step |
| tpu_pod_hbm_used_bytes | gauge | chip, core | HBM in use |
| tpu_pod_hbm_peak_bytes | gauge | chip, core | HBM high-water mark |
| tpu_pod_hbm_capacity_bytes | gauge | chip, core | HBM capacity |
| tpu_pod_ici_transferred_bytes_total | counter | link | bytes sent over a directed ICI link |
| tpu_pod_ici_link_utilization_ratio | gauge | link | link bytes / (bandwidth x step time), last step |
| tpu_pod_simulated_collective_seconds | histogram | | a step's simulated collective time, every mesh axis |
| tpu_pod_collective_seconds_total | counter | axis | simulated seconds of the collectives over a mesh axis |
| tpu_pod_collective_exposed_seconds_total | counter | axis | the part of them the compute waited for |
| tpu_pod_collective_bytes_total | counter | axis | bytes a device passed to them |
| tpu_pod_dcn_collective_seconds_total | counter | axis | the axis's seconds across slices (DCN) |
| tpu_pod_dcn_transferred_bytes_total | counter | axis | bytes a device sent across the DCN |
| tpu_pod_expert_routed_tokens | gauge | expert | last step: token choices routed to the expert, every MoE layer, every device (mixture of experts) |
| tpu_pod_expert_load_max_over_mean_ratio | gauge | | last step: the busiest expert's choices over the mean, worst layer (1: balanced) |
| tpu_pod_expert_dropped_ratio | gauge | | last step: the share of token choices over capacity |
| tpu_pod_wall_step_seconds | histogram | | host wall time per step |
| tpu_pod_emulation_slowdown_ratio | gauge | | wall seconds / simulated seconds, last step |
| tpu_pod_emulation_rate_ratio | gauge | | simulated seconds per wall second, last step |
"""  # noqa: E501 - the table's rows cannot wrap

from __future__ import annotations

import errno
import functools
import math
import socket
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pod.errors import MetricsError
from pod.report.stats import StepStats

__all__ = ["PodMetrics", "METRIC_NAMES", "MAX_EXPERT_LABELS", "simulated_buckets"]

#: expert label values at most (the experts past them add up under "other"): the
#: largest published routers have 256 experts (DeepSeek-V3)
MAX_EXPERT_LABELS = 256

# simulated seconds: a small model's allreduce on a few chips takes ~10 us, a big
# model's step on a big pod seconds
_SIM_BUCKETS = (1e-7, 2.5e-7, 5e-7, 1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
                1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: fine buckets per factor of 2 around a run's first simulated time (2.2% each), and how
#: many factors of 2 they span either side
_FINE_PER_OCTAVE, _FINE_OCTAVES = 32, 1


def simulated_buckets(first_seconds: float) -> tuple[float, ...]:
    """Histogram bucket edges for a run's simulated times, from its first one: 2.2% apart
    from half to twice it (a run's steps stay near their first: a straggler or a slow
    link moves them by tens of percent), an edge just below it (a run of equal steps reads
    its step time at every quantile, not the middle of a decade's bucket: 0.075 and
    0.0995 ms for a constant 0.0720 ms step), and the 1-2.5-5 decades from 100 ns to 10 s
    beyond (``_SIM_BUCKETS``). ``_SIM_BUCKETS`` alone for a first time of 0."""
    if not first_seconds > 0:
        return _SIM_BUCKETS
    n = _FINE_PER_OCTAVE * _FINE_OCTAVES
    fine = [first_seconds * 2.0 ** (k / _FINE_PER_OCTAVE) for k in range(-n, n + 1)]
    fine.append(first_seconds * (1.0 - 1e-6))
    low, high = fine[0], fine[-2]
    return tuple(sorted({*fine, *(b for b in _SIM_BUCKETS if not low <= b <= high)}))
_WALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

METRIC_NAMES = (
    "tpu_pod_info", "tpu_pod_steps_total", "tpu_pod_examples_total",
    "tpu_pod_simulated_step_seconds", "tpu_pod_simulated_step_part_seconds",
    "tpu_pod_simulated_examples_per_second", "tpu_pod_simulated_flops_per_second",
    "tpu_pod_mfu_ratio", "tpu_pod_loss", "tpu_pod_test_accuracy_ratio",
    "tpu_pod_mxu_utilization_ratio", "tpu_pod_hbm_used_bytes", "tpu_pod_hbm_peak_bytes",
    "tpu_pod_hbm_capacity_bytes",
    "tpu_pod_ici_transferred_bytes_total", "tpu_pod_ici_link_utilization_ratio",
    "tpu_pod_simulated_collective_seconds", "tpu_pod_wall_step_seconds",
    "tpu_pod_emulation_slowdown_ratio", "tpu_pod_emulation_rate_ratio",
    "tpu_pod_collective_overlap_ratio", "tpu_pod_simulated_tokens_per_second",
    "tpu_pod_simulated_chip_compute_seconds", "tpu_pod_collective_seconds_total",
    "tpu_pod_collective_exposed_seconds_total", "tpu_pod_collective_bytes_total",
    "tpu_pod_simulated_tflops_per_device",
    "tpu_pod_expert_routed_tokens", "tpu_pod_expert_load_max_over_mean_ratio",
    "tpu_pod_expert_dropped_ratio", "tpu_pod_dcn_collective_seconds_total",
    "tpu_pod_dcn_transferred_bytes_total",
)


class PodMetrics:
    """The metric set of one run, on a registry of its own.

    Args:
        scenario: scenario name (info label).
        chip: chip generation preset, e.g. "v4" (the info label ``generation``).
        slice_name: slice or pod name (info label).
        topology: torus shape, e.g. "2x2" (info label).
        dataset, synthetic: the training data's name and whether it is
            synthetic (info labels: synthetic data is labelled as such).
        links: every directed ICI link ("src->dst"): their byte counters start at
            0 and their utilisation is set for every link at every step, so a link
            the collective never uses shows as idle, not missing.
        chips: pod size.
        devices_per_chip: devices per chip (2 on v2 / v3: a device per TensorCore,
            labelled by its ``core``).
    """

    def __init__(self, *, scenario: str, generation: str, slice_name: str, topology: str,
                 links: Sequence[str] = (), chips: int = 0, devices_per_chip: int = 1,
                 dataset: str = "", synthetic: bool = False) -> None:
        self.devices_per_chip = max(1, int(devices_per_chip))
        self.registry = CollectorRegistry()
        r = self.registry
        self.info = Gauge("tpu_pod_info", "The emulated pod (value 1).",
                          ["scenario", "generation", "slice", "topology", "dataset", "synthetic"],
                          registry=r)
        self.info.labels(scenario, generation, slice_name, topology, dataset,
                         "true" if synthetic else "false").set(1)
        self.steps = Counter("tpu_pod_steps", "Training steps done.", registry=r)
        self.examples = Counter("tpu_pod_examples", "Training examples processed.", registry=r)
        self.step_seconds: Histogram | None = None  # at the first step, its buckets around it
        self.part_seconds = Gauge("tpu_pod_simulated_step_part_seconds",
                                  "Simulated time of the parts of the last step.", ["part"],
                                  registry=r)
        later = functools.partial(Gauge, registry=None)  # registered when there is a value
        self.examples_per_second = later("tpu_pod_simulated_examples_per_second",
                                         "Simulated examples/s of the last step.")
        self.tokens_per_second = later("tpu_pod_simulated_tokens_per_second",
                                       "Simulated tokens/s of the last step (sequence models).")
        self.flops_per_second = later("tpu_pod_simulated_flops_per_second",
                                      "Simulated model FLOP/s of the last step.")
        self.mfu = later("tpu_pod_mfu_ratio", "Model FLOPs utilisation of the last step (0..1).")
        self.tflops_per_device = later(
            "tpu_pod_simulated_tflops_per_device", "TFLOP/s per device of the last step as "
            "MaxText prints it (maxtext_utils.calculate_tflops_training_per_device).")
        self.loss = later("tpu_pod_loss", "Training loss of the last step.")
        self.accuracy = later("tpu_pod_test_accuracy_ratio", "Last test accuracy (0..1).")
        self.mxu_utilization = Gauge("tpu_pod_mxu_utilization_ratio",
                                     "MXU FLOPs / (device peak FLOP/s x simulated step time), "
                                     "0..1.",
                                     ["chip", "core"], registry=r)
        self.chip_compute_seconds = Gauge(
            "tpu_pod_simulated_chip_compute_seconds",
            "Simulated forward + backward of a chip's slowest device, last step (a straggler "
            "stands out here).", ["chip"], registry=r)
        self.hbm_used = Gauge("tpu_pod_hbm_used_bytes", "HBM bytes in use.", ["chip", "core"],
                              registry=r)
        self.hbm_peak = Gauge("tpu_pod_hbm_peak_bytes", "HBM high-water mark in bytes.",
                              ["chip", "core"], registry=r)
        self.hbm_capacity = Gauge("tpu_pod_hbm_capacity_bytes", "HBM capacity in bytes.",
                                  ["chip", "core"], registry=r)
        self.ici_bytes = Counter("tpu_pod_ici_transferred_bytes",
                                 "Bytes sent over a directed ICI link.", ["link"], registry=r)
        self.ici_utilization = Gauge("tpu_pod_ici_link_utilization_ratio",
                                     "Directed ICI link bytes / (bandwidth x simulated step time).",
                                     ["link"], registry=r)
        self.collective_step_seconds: Histogram | None = None  # the same
        self.wall_seconds = Histogram("tpu_pod_wall_step_seconds", "Host wall time per step.",
                                      buckets=_WALL_BUCKETS, registry=r)
        self.slowdown = later("tpu_pod_emulation_slowdown_ratio",
                              "Wall seconds per simulated second, last step.")
        self.overlap = later("tpu_pod_collective_overlap_ratio", "Share of the last step's "
                             "collectives hidden behind the compute, 0..1.")
        self.rate = later("tpu_pod_emulation_rate_ratio",
                          "Simulated seconds per wall second, last step.")
        self._axis_metrics(r)
        self._expert_metrics(r)
        self._links = tuple(links)
        for link in links:  # a counter at 0 is true before the first step: nothing sent yet
            self.ici_bytes.labels(link)
        self._step_gauges = (self.examples_per_second, self.flops_per_second, self.mfu,
                             self.slowdown, self.overlap, self.rate)
        self._registered: set[Any] = set()
        self._server: Any = None
        self.port = 0

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP.

        Args:
            port: TCP port; 0 disables the endpoint.
            host: address to bind (loopback by default).

        Returns:
            The port served (0 when disabled).

        Raises:
            MetricsError: the port is in use or cannot be bound (``metrics.port``), or
                the host is not an address of this machine (``metrics.host``).
        """
        if port == 0:
            return 0
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise MetricsError(
                    f"metrics.port: port {port} on {host} is already in use; choose a free port "
                    f"with --metrics-port, or 0 to disable the endpoint") from None
            if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL:
                raise MetricsError(f"metrics.host: cannot serve on {host!r} "
                                   f"({err.strerror or err}); "
                                   "use 127.0.0.1, or an address of this machine") from None
            raise MetricsError(f"metrics.port: cannot serve on {host}:{port}: "
                               f"{err.strerror}") from None
        self._server = server
        self.port = port
        return port

    def close(self) -> None:
        """Stop the HTTP endpoint if it runs."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _labels(self, device: int) -> tuple[str, str]:
        """(chip, core) labels of a device id."""
        chip, core = divmod(int(device), self.devices_per_chip)
        return str(chip), str(core)

    def observe_axes(self, stats: StepStats) -> None:
        """Add a step's per-mesh-axis collective seconds, exposed seconds and bytes."""
        for axis, seconds in stats.axis_collective_seconds.items():
            self.collective_seconds.labels(axis).inc(seconds)
            self.collective_exposed_seconds.labels(axis).inc(
                stats.axis_exposed_seconds.get(axis, 0.0))
            self.collective_bytes.labels(axis).inc(stats.axis_collective_bytes.get(axis, 0))
        for axis, seconds in stats.axis_dcn_seconds.items():  # axes across slices only
            self.dcn_seconds.labels(axis).inc(seconds)
            self.dcn_bytes.labels(axis).inc(stats.axis_dcn_bytes.get(axis, 0))

    def _register(self, *gauges: Any) -> None:
        """Register gauges made with no registry (exported from now on), once each."""
        for gauge in gauges:
            if gauge not in self._registered:
                self.registry.register(gauge)
                self._registered.add(gauge)

    def _axis_metrics(self, r: CollectorRegistry) -> None:
        """The per-mesh-axis collective counters."""
        self.collective_seconds = Counter(
            "tpu_pod_collective_seconds", "Simulated seconds of the collectives per mesh axis.",
            ["axis"], registry=r)
        self.collective_exposed_seconds = Counter(
            "tpu_pod_collective_exposed_seconds", "Simulated seconds the compute stream waited "
            "for the collectives, per mesh axis.", ["axis"], registry=r)
        self.collective_bytes = Counter(
            "tpu_pod_collective_bytes", "Bytes a device passed to the collectives per mesh "
            "axis (the slowest device's).", ["axis"], registry=r)
        self.dcn_seconds = Counter(
            "tpu_pod_dcn_collective_seconds", "Simulated seconds of a mesh axis's collectives "
            "spent across the data-centre network between slices (multislice).", ["axis"],
            registry=r)
        self.dcn_bytes = Counter(
            "tpu_pod_dcn_transferred_bytes", "Bytes a device sent across the data-centre "
            "network in a mesh axis's collectives (the slowest device's).", ["axis"], registry=r)

    def _expert_metrics(self, r: CollectorRegistry) -> None:
        """The routers' gauges (a mixture of experts; registered at its first routed step,
        absent for a dense model or a timing-only run)."""
        del r  # registered by observe_experts
        self.expert_tokens = Gauge(
            "tpu_pod_expert_routed_tokens", "Token choices routed to the expert in the last "
            "step, every MoE layer and device.", ["expert"], registry=None)
        self.expert_imbalance = Gauge(
            "tpu_pod_expert_load_max_over_mean_ratio", "The busiest expert's token choices over "
            "the mean in the last step, worst MoE layer (1: balanced).", registry=None)
        self.expert_dropped = Gauge(
            "tpu_pod_expert_dropped_ratio", "Share of the last step's token choices over an "
            "expert's capacity.", registry=None)

    def observe_experts(self, stats: StepStats) -> None:
        """Set the routers' load of a step (a mixture of experts; nothing otherwise)."""
        load = stats.expert_load
        if load is None:
            return
        self._register(self.expert_tokens, self.expert_imbalance, self.expert_dropped)
        tokens = load.tokens_per_expert
        for e, n in enumerate(tokens[:MAX_EXPERT_LABELS]):
            self.expert_tokens.labels(str(e)).set(n)
        if len(tokens) > MAX_EXPERT_LABELS:
            self.expert_tokens.labels("other").set(sum(tokens[MAX_EXPERT_LABELS:]))
        self.expert_imbalance.set(load.max_over_mean)
        self.expert_dropped.set(load.dropped_fraction)

    def observe(self, stats: StepStats) -> None:
        """Record one step (the first registers the gauges of the last step)."""
        self._register(*self._step_gauges)
        if stats.tokens_per_example:
            self._register(self.tokens_per_second)
        self.steps.inc()
        self.examples.inc(stats.global_batch)
        if self.step_seconds is None:
            self.step_seconds = Histogram(
                "tpu_pod_simulated_step_seconds", "Simulated TPU step time.",
                buckets=simulated_buckets(stats.step_seconds), registry=self.registry)
            self.collective_step_seconds = Histogram(
                "tpu_pod_simulated_collective_seconds",
                "Simulated collective time of a step, every mesh axis.",
                buckets=simulated_buckets(stats.collective_seconds), registry=self.registry)
        self.step_seconds.observe(stats.step_seconds)
        self.observe_axes(stats)
        self.observe_experts(stats)
        for part, value in (("infeed", stats.infeed_seconds), ("compute", stats.compute_seconds),
                            ("collective", stats.collective_seconds),
                            ("exposed_infeed", stats.exposed_infeed_seconds),
                            ("exposed_collective", stats.exposed_collective_seconds),
                            ("dispatch", stats.dispatch_seconds),
                            ("pipeline_bubble", stats.pipeline_bubble_seconds),
                            ("host_offload", stats.host_offload_seconds),
                            ("exposed_host_offload", stats.exposed_host_offload_seconds),
                            ("update", stats.update_seconds)):
            self.part_seconds.labels(part).set(value)
        self.overlap.set(stats.overlap_fraction)
        self.examples_per_second.set(stats.examples_per_second)
        self.tokens_per_second.set(stats.tokens_per_second)
        self.flops_per_second.set(stats.flops_per_second)
        self.mfu.set(stats.mfu)
        if stats.maxtext_flops_per_device:
            self._register(self.tflops_per_device)
            self.tflops_per_device.set(stats.maxtext_tflops_per_device)
        if math.isfinite(stats.loss) or self.loss in self._registered:
            self._register(self.loss)  # absent until a finite loss (timing-only: never)
            self.loss.set(stats.loss)
        for device, used in stats.hbm_used_bytes.items():
            self.hbm_used.labels(*self._labels(device)).set(used)
            self.hbm_capacity.labels(*self._labels(device)).set(stats.hbm_capacity_bytes)
        for device, peak in stats.hbm_peak_bytes.items():
            self.hbm_peak.labels(*self._labels(device)).set(peak)
        for link, nbytes in stats.ici_link_bytes.items():
            self.ici_bytes.labels(link).inc(nbytes)
        ratios = stats.ici_link_utilization()
        for link in self._links:  # a link that carried nothing (failed, idle) reads 0
            self.ici_utilization.labels(link).set(ratios.get(link, 0.0))
        for link, ratio in ratios.items():
            self.ici_utilization.labels(link).set(ratio)
        for device, ratio in stats.mxu_utilization().items():
            self.mxu_utilization.labels(*self._labels(device)).set(ratio)
        for chip, seconds in stats.chip_compute_seconds.items():
            self.chip_compute_seconds.labels(str(chip)).set(seconds)
        assert self.collective_step_seconds is not None  # made with step_seconds, above
        self.collective_step_seconds.observe(stats.collective_seconds)
        self.wall_seconds.observe(stats.wall_seconds)
        if stats.step_seconds > 0:
            self.slowdown.set(stats.emulation_slowdown)
        if stats.wall_seconds > 0:
            self.rate.set(stats.step_seconds / stats.wall_seconds)

    def set_accuracy(self, accuracy: float | None) -> None:
        """Record the latest test accuracy (0..1); None or NaN (no example evaluated)
        records nothing: the metric stays absent or at the last evaluated value, never
        a made-up 0."""
        if accuracy is None or not math.isfinite(accuracy):
            return
        self._register(self.accuracy)
        self.accuracy.set(accuracy)
