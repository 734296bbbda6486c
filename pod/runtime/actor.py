"""``ChipActor``: one emulated TPU chip, the thin Ray shell around ``chip.Chip``.

The class is plain Python so it can be exercised in-process; the coordinator
wraps it with ``ray.remote``. It holds one model replica (parameters and
optimizer state) per TensorCore, as a real chip does under data parallelism.

One training step, seen from a chip (docs/ARCHITECTURE.md):

1. ``compute``: each TensorCore runs forward + backward on its shard; the
   chip then reduces its cores' gradients locally (an on-chip vector add,
   costed on core 0) into one flat float32 buffer.
2. ``run_collective`` (one call): run this chip's part of the allreduce
   schedule, sending chunks straight to the receiving chips and applying
   the ones it receives (``pod.runtime.ici``); the driver never handles
   gradient bytes.
3. ``apply``: every core divides the sum by the number of replicas and runs
   the optimizer on its own replica. The same bytes in give the same bytes
   out, so replicas stay bit-identical (checked by ``digests``).

``train_step`` runs the three in one call (the pod's step), with the part of
the schedule ``set_collective`` handed over once.

What a call returns is a frozen dataclass (``ComputeReport``,
``ApplyReport``, ``Evaluation``, ``Snapshot``), never a dict read back by key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from chip import Chip, ChipSpec, OpRecord
from pod.report.stats import RecordTotals
from pod.state.checkpoint import params_digest
from pod.workloads import Model, build_optimizer

__all__ = ["ChipActor", "flatten", "unflatten", "HbmUsage", "ComputeReport", "ApplyReport",
           "StepReport", "Evaluation", "Snapshot", "TraceRow"]

#: One op of a timeline: (name, unit, simulated seconds, flops, hbm_bytes, bound).
TraceRow = tuple[str, str, float, int, int, str]


@dataclass(frozen=True)
class HbmUsage:
    """One TensorCore's HBM, bytes."""

    used_bytes: int
    peak_bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class ComputeReport:
    """What ``ChipActor.compute`` returns: one chip's forward + backward.

    Per-core tuples are indexed by TensorCore. Seconds are simulated.

    Attributes:
        losses: each core's training loss on its shard.
        compute_seconds: each core's forward + backward.
        mxu_flops: each core's MXU FLOPs (model FLOPs of the step).
        local_reduce_seconds: the on-chip reduce of the cores' gradients.
        grad_ready_seconds: each core's {layer: simulated seconds from the start
            of its forward pass until the backward pass has finished that
            layer's gradients} (the overlapped allreduce starts a bucket then).
        hbm: each core's HBM after the step's allocations.
        trace: each core's op rows (empty unless traced).
        local_reduce_trace: the local reduce's op rows (empty unless traced).
        bound_seconds: each core's forward + backward seconds by what bounds
            each op ("mxu", "vpu", "scalar", "hbm"; ``RecordTotals``).
    """

    losses: tuple[float, ...]
    compute_seconds: tuple[float, ...]
    mxu_flops: tuple[int, ...]
    local_reduce_seconds: float
    hbm: tuple[HbmUsage, ...]
    grad_ready_seconds: tuple[dict[str, float], ...] = ()
    trace: tuple[tuple[TraceRow, ...], ...] = ()
    local_reduce_trace: tuple[TraceRow, ...] = ()
    bound_seconds: tuple[dict[str, float], ...] = ()


@dataclass(frozen=True)
class ApplyReport:
    """What ``ChipActor.apply`` returns: one chip's optimizer update.

    Attributes:
        update_seconds: each core's update (simulated).
        hbm: each core's HBM.
        trace: each core's op rows (empty unless traced).
        bound_seconds: each core's update seconds by what bounds each op.
    """

    update_seconds: tuple[float, ...]
    hbm: tuple[HbmUsage, ...]
    trace: tuple[tuple[TraceRow, ...], ...] = ()
    bound_seconds: tuple[dict[str, float], ...] = ()


@dataclass(frozen=True)
class StepReport:
    """What ``ChipActor.train_step`` returns: the chip's whole data-parallel step."""

    compute: ComputeReport
    apply: ApplyReport


@dataclass(frozen=True)
class Evaluation:
    """Test loss (mean per prediction) and accuracy (0..1) of one replica."""

    loss: float
    accuracy: float


@dataclass(frozen=True)
class Snapshot:
    """What a checkpoint needs from one chip (``ChipActor.snapshot``).

    Attributes:
        digests: per core, (parameters sha256, optimizer state sha256).
        model_state: per core, a copy of its model state.
        params: core 0's parameters (only when asked for: ``full``).
        optimizer_state: core 0's optimizer state (likewise).
    """

    digests: tuple[tuple[str, str], ...]
    model_state: tuple[dict[str, np.ndarray], ...]
    params: dict[str, np.ndarray] | None = None
    optimizer_state: dict[str, np.ndarray] | None = None


def flatten(tensors: dict[str, np.ndarray]) -> np.ndarray:
    """Concatenate arrays, in dict order, into one float32 vector of shape (P,)."""
    return np.concatenate([np.ravel(t).astype(np.float32, copy=False) for t in tensors.values()])


def unflatten(flat: np.ndarray, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Cut a (P,) vector back into arrays shaped like ``like`` (views of ``flat``)."""
    out, start = {}, 0
    for name, ref in like.items():
        stop = start + ref.size
        out[name] = flat[start:stop].reshape(ref.shape)
        start = stop
    return out


class ChipActor:
    """One chip: its TensorCores, their model replicas and the gradient buffer.

    Args:
        spec: the chip preset.
        chip_id: this chip's rank in the pod (its ICI topology rank).
        model: the model (stateless; parameters live here).
        optimizer_name: "adam" or "sgd".
        optimizer_options: keyword arguments of the optimizer.
        seed: the scenario seed; parameters start from ``model.init_params(seed)``
            on every core, so all replicas start identical.
        num_replicas: TensorCores in the whole pod (the allreduce sum is
            divided by it).
        numerics: TPU numerics (MXU inputs per ``precision``) when True.
        limit_threads: pin BLAS to one thread (several actors share few cores).
        precision: MXU precision of every core: "bf16", "fp32" or "int8"
            (the scenario's ``training.precision``).
        mxu_model: the MXU cycle count, "pipelined" or "scalesim" (``pod.mxu_model``).
        core_threads: run the TensorCores' forward + backward in parallel threads
            (numpy releases the GIL in its kernels), for machines with a CPU core
            to spare per TensorCore; the results are the same bits either way.

    Raises:
        HBMOutOfMemoryError: the parameters, gradients or optimizer state do
            not fit in a core's HBM.
    """

    def __init__(self, spec: ChipSpec, chip_id: int, model: Model, optimizer_name: str,
                 optimizer_options: dict[str, Any], seed: int, num_replicas: int,
                 numerics: bool = True, limit_threads: bool = True,
                 precision: str = "bf16", mxu_model: str = "pipelined",
                 core_threads: bool = False) -> None:
        if limit_threads:
            from threadpoolctl import threadpool_limits
            threadpool_limits(1)
        self.chip = Chip(spec, chip_id, numerics=numerics, precision=precision, mxu_model=mxu_model)
        self.chip_id = chip_id
        self.model = model
        self.optimizer = build_optimizer(optimizer_name, **optimizer_options)
        self.num_replicas = num_replicas
        init = model.init_params(seed)
        self.params = [{k: v.copy() for k, v in init.items()} for _ in self.chip.cores]
        self.opt_state = [self.optimizer.init(p) for p in self.params]
        # non-trainable state (BatchNorm running averages): per replica, from its own shards
        self.model_state = [model.init_state() for _ in self.chip.cores]
        params_bytes = int(sum(v.nbytes for v in init.values()))
        for core in self.chip.cores:
            core.hbm.allocate("params", params_bytes)
            core.hbm.allocate("grads", params_bytes)
            core.hbm.allocate("optimizer_state", self.optimizer.state_bytes(init))
        self.grad_flat: np.ndarray | None = None
        self.chunk_bounds: tuple[tuple[int, int], ...] = ()
        # a straggler (scenario faults: slow_chip): simulated compute seconds x this factor
        self.compute_slowdown = 1.0
        self._activation_bytes: dict[int, int] = {}  # per-core batch -> model.activation_bytes
        self._pool = None
        if core_threads and len(self.chip.cores) > 1:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(len(self.chip.cores), thread_name_prefix="tensorcore")
        # this chip's part of the data-parallel allreduce (``set_collective``)
        self._collective: tuple[Any, tuple[int, ...], tuple[tuple[str, int], ...]] | None = None

    # -- set-up and inspection -------------------------------------------------

    def node_id(self) -> str:
        """The Ray node this actor runs on ("" outside Ray)."""
        try:
            import ray
            return ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - outside a Ray worker
            return ""

    def set_chunk_bounds(self, bounds: Sequence[Sequence[int]]) -> None:
        """Store the allreduce schedule's chunk element ranges [(start, stop), ...]."""
        self.chunk_bounds = tuple((int(a), int(b)) for a, b in bounds)

    def set_buffer(self, buffer: np.ndarray) -> None:
        """Replace the gradient buffer, (P,) float32 (tests and benchmarks)."""
        self.grad_flat = np.array(buffer, dtype=np.float32, copy=True)

    def get_buffer(self) -> np.ndarray:
        """A copy of the gradient buffer, (P,) float32."""
        return self.grad_flat.copy()

    def digests(self) -> list[str]:
        """SHA-256 of each core's parameter bytes, in dict order (``params_digest``)."""
        return [params_digest(params) for params in self.params]

    def get_params(self, core: int = 0) -> dict[str, np.ndarray]:
        """A copy of one core's parameters."""
        return {k: v.copy() for k, v in self.params[core].items()}

    def get_model_state(self, core: int = 0) -> dict[str, np.ndarray]:
        """A copy of one core's model state (BatchNorm running averages; {} if none)."""
        return {k: v.copy() for k, v in self.model_state[core].items()}

    def get_opt_state(self, core: int = 0) -> dict[str, np.ndarray]:
        """A copy of one core's optimizer state."""
        return {k: v.copy() for k, v in self.opt_state[core].items()}

    def hbm(self) -> tuple[HbmUsage, ...]:
        """Each core's HBM in use, high-water mark and capacity."""
        return tuple(HbmUsage(c.hbm.used_bytes, c.hbm.peak_bytes, c.hbm.capacity_bytes)
                     for c in self.chip.cores)

    def set_compute_slowdown(self, factor: float) -> None:
        """Make this chip a straggler: its simulated forward + backward seconds (and
        their op records) are multiplied by ``factor`` >= 1 from the next step on.

        Raises:
            ValueError: factor < 1 or not finite.
        """
        if not (np.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"compute slowdown must be a finite factor >= 1, got {factor!r}")
        self.compute_slowdown = float(factor)

    def snapshot(self, full: bool = False) -> Snapshot:
        """What a checkpoint needs from this chip.

        Args:
            full: also return core 0's parameters and optimizer state (the
                coordinator asks one chip; the others only send digests).
        """
        return Snapshot(
            digests=tuple((d, params_digest(o)) for d, o in zip(self.digests(), self.opt_state)),
            model_state=tuple(self.get_model_state(c) for c in range(len(self.chip.cores))),
            params=self.get_params(0) if full else None,
            optimizer_state=self.get_opt_state(0) if full else None)

    def restore(self, params: dict[str, np.ndarray], optimizer_state: dict[str, np.ndarray],
                model_state: Sequence[dict[str, np.ndarray]]) -> list[str]:
        """Load a checkpoint's state into every core (a copy each, writable).

        Args:
            params: the parameters, name -> array shaped like ``model.param_shapes``.
            optimizer_state: the optimizer slots.
            model_state: per core, its model state.

        Returns:
            ``digests()`` after the load (the coordinator compares them with the
            checkpoint's).

        Raises:
            ValueError: a name or shape that does not fit the model, or the wrong
                number of per-core model states.
        """
        ref = self.params[0]
        if set(params) != set(ref) or any(np.shape(params[k]) != ref[k].shape for k in ref):
            raise ValueError("checkpoint parameters do not fit this model")
        if len(model_state) != len(self.chip.cores):
            raise ValueError(f"checkpoint has model state for {len(model_state)} cores, "
                             f"this chip has {len(self.chip.cores)}")
        self.params = [{k: np.array(params[k], dtype=ref[k].dtype, copy=True) for k in ref}
                       for _ in self.chip.cores]
        self.opt_state = [{k: np.array(v, copy=True) for k, v in optimizer_state.items()}
                          for _ in self.chip.cores]
        self.model_state = [{k: np.array(v, copy=True) for k, v in state.items()}
                            for state in model_state]
        self.grad_flat = None
        return self.digests()

    # -- one training step -----------------------------------------------------

    def compute(self, step: int, x: np.ndarray, y: np.ndarray, seed: int,
                trace: bool = False) -> ComputeReport:
        """Forward + backward on every core, then the on-chip gradient reduce.

        Args:
            step: zero-based step number (seeds the dropout streams).
            x: this chip's examples, (B_chip, ...) float32; core i takes rows
                [i*b, (i+1)*b) with b = B_chip / cores.
            y: labels, (B_chip,) int64.
            seed: the scenario seed.
            trace: also return every op record (per core, and the local reduce's).

        Returns:
            The chip's report; the reduced gradients stay in this actor for
            the collective.
        """
        cores = self.chip.cores
        b = x.shape[0] // len(cores)
        if b not in self._activation_bytes:
            self._activation_bytes[b] = self.model.activation_bytes(b)

        def one_core(i: int) -> tuple:
            return self._core_step(i, step, x[i * b:(i + 1) * b], y[i * b:(i + 1) * b], seed,
                                   trace)

        outs = (list(self._pool.map(one_core, range(len(cores)))) if self._pool is not None
                else [one_core(i) for i in range(len(cores))])
        losses, totals, ready, traces, flats = (list(v) for v in zip(*outs))
        reducer = cores[0]
        acc = flats[0]
        for other in flats[1:]:
            if self.chip.spec.megacore:  # the cores are one device: no separate reduce to cost
                acc = np.add(acc, other)
            else:
                acc = reducer.vector("local_reduce", np.add, acc, other)
        reduce_records = reducer.take_records()
        self.grad_flat = np.array(acc, dtype=np.float32, copy=True)
        return ComputeReport(
            losses=tuple(losses),
            compute_seconds=tuple(t.seconds for t in totals),
            mxu_flops=tuple(t.mxu_flops for t in totals),
            local_reduce_seconds=RecordTotals.of(reduce_records).seconds,
            hbm=self.hbm(),
            grad_ready_seconds=tuple(ready),
            trace=tuple(traces) if trace else (),
            local_reduce_trace=_trace_rows(reduce_records) if trace else (),
            bound_seconds=tuple(t.bound_seconds for t in totals))

    def _core_step(self, i: int, step: int, x: np.ndarray, y: np.ndarray, seed: int,
                   trace: bool) -> tuple:
        """Forward + backward of core ``i`` on its shard (touches only core ``i``'s
        state, so cores may run in parallel threads): (loss, totals, layer ends,
        trace rows, flat gradients)."""
        core = self.chip.cores[i]
        rng = np.random.default_rng([seed, step, self.chip_id, i])
        core.hbm.allocate("activations", self._activation_bytes[x.shape[0]])
        loss, grads, self.model_state[i] = self.model.loss_grads_and_state(
            core, self.params[i], x, y, state=self.model_state[i], rng=rng)
        core.hbm.free("activations")
        records = self._slowed(core.take_records())
        return (float(loss), RecordTotals.of(records), _layer_ends(records),
                _trace_rows(records) if trace else (), flatten(grads))

    def _slowed(self, records: list[OpRecord]) -> list[OpRecord]:
        """A straggler's records take ``compute_slowdown`` times longer."""
        f = self.compute_slowdown
        if f == 1.0:
            return records
        return [dataclasses.replace(r, seconds=r.seconds * f, compute_seconds=r.compute_seconds * f,
                                    memory_seconds=r.memory_seconds * f) for r in records]

    def ici_address(self, key: bytes = b"") -> tuple[str, int]:
        """(host, port) where this chip receives chunks from its peers (``pod.runtime.ici``;
        the port opens on first use, with the pod's link ``key``)."""
        return self._ici_port(key).address

    def run_collective(self, run_id: int, plan: Sequence[Any], peers: Sequence[int],
                       *addresses: tuple[str, int]) -> None:
        """Run this chip's part of an allreduce schedule, chip to chip (``pod.runtime.ici``).

        Args:
            run_id: the collective's id, the same on every chip.
            plan: this rank's phases (``pod.runtime.ici.RankPlan``).
            peers: the ranks this chip sends to, in the order of ``addresses``.
            addresses: their ``ici_address()`` (Ray resolves the references).

        Raises:
            IciError: a chunk did not arrive (the peer died, the link closed, or
                the wait timed out); the buffer is dropped so that ``apply``
                refuses to run on a partial sum.
        """
        try:
            self._ici_port().run(run_id, plan, dict(zip(peers, addresses)), self.grad_flat,
                                 self.chunk_bounds)
        except BaseException:
            self.grad_flat = None  # partly reduced: ``apply`` must refuse it
            raise

    def set_collective(self, plan: Sequence[Any], peers: Sequence[int],
                       addresses: Sequence[tuple[str, int]]) -> None:
        """Keep this chip's part of the data-parallel allreduce for ``train_step``:
        its phases (``pod.runtime.ici.RankPlan``), the ranks it sends to and their
        ``ici_address()``, in the same order (the coordinator sends them once, and
        again when a chip is replaced)."""
        self._collective = (plan, tuple(peers), tuple(tuple(a) for a in addresses))

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, seed: int, run_id: int,
                   trace: bool = False) -> StepReport:
        """A whole data-parallel step in one call: ``compute``, this chip's part of
        the allreduce (as ``set_collective`` gave it, run ``run_id``, the same on
        every chip), then ``apply``. One actor call per chip per step instead of
        three (and no driver round trip between them).

        Raises:
            RuntimeError: ``set_collective`` has not been called.
            IciError: the collective failed (as ``run_collective``); nothing was
                applied and the buffer is dropped.
        """
        if self._collective is None:
            raise RuntimeError(f"chip {self.chip_id}: train_step before set_collective")
        computed = self.compute(step, x, y, seed, trace)
        plan, peers, addresses = self._collective
        self.run_collective(run_id, plan, peers, *addresses)
        return StepReport(computed, self.apply(step, trace))

    def _ici_port(self, key: bytes = b"") -> Any:
        port = getattr(self, "_ici", None)
        if port is None:
            from pod.runtime.ici import IciPort
            port = self._ici = IciPort(self.chip_id, key)
        return port

    def apply(self, step: int, trace: bool = False) -> ApplyReport:
        """Average the allreduced gradients and update every core's replica.

        Args:
            step: zero-based step number (the optimizer counts from step + 1).
            trace: also return every op record per core.

        Raises:
            RuntimeError: no reduced gradients to apply (``compute`` and the
                collective did not both run since the last update).
        """
        if self.grad_flat is None:
            raise RuntimeError(f"chip {self.chip_id}: apply at step {step + 1} without "
                               "reduced gradients")
        seconds, traces, bounds = [], [], []
        scale = np.float32(1.0 / self.num_replicas)
        for i, core in enumerate(self.chip.cores):
            mean = core.vector("grad_mean", np.multiply, self.grad_flat, scale)
            grads = unflatten(mean, self.params[i])
            self.params[i], self.opt_state[i] = self.optimizer.update(
                core, grads, self.opt_state[i], self.params[i], step + 1)
            records = core.take_records()
            totals = RecordTotals.of(records)
            seconds.append(totals.seconds)
            bounds.append(totals.bound_seconds)
            traces.append(_trace_rows(records) if trace else ())
        self.grad_flat = None
        return ApplyReport(update_seconds=tuple(seconds), hbm=self.hbm(),
                           trace=tuple(traces) if trace else (), bound_seconds=tuple(bounds))

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch: int = 512,
                 state: dict[str, np.ndarray] | None = None) -> Evaluation:
        """Test loss and accuracy of core 0's replica (eval mode: no dropout,
        BatchNorm on running averages: ``state`` if given, else core 0's).
        Per-step labels (char_lstm) count every step as a prediction."""
        core = self.chip.cores[0]
        state = self.model_state[0] if state is None else state
        correct, loss_sum, count = 0, 0.0, 0
        for start in range(0, x.shape[0], batch):
            s, c, n = self.model.evaluate_sums(core, self.params[0], x[start:start + batch],
                                               y[start:start + batch], state=state)
            loss_sum, correct, count = loss_sum + s, correct + c, count + n
        core.take_records()
        n = max(1, count)
        return Evaluation(loss=loss_sum / n, accuracy=correct / n)


def _layer_ends(records: Sequence[OpRecord]) -> dict[str, float]:
    """{layer: simulated seconds from the first record to the end of that layer's
    last record}; records are named ``<layer>/<op>`` and run back to back, so a
    layer's last record is the end of its backward pass."""
    ends: dict[str, float] = {}
    t = 0.0
    for rec in records:
        t += rec.seconds
        ends[rec.name.split("/", 1)[0]] = t
    return ends


def _trace_rows(records: Sequence[OpRecord]) -> tuple[TraceRow, ...]:
    """Op records as plain tuples (name, unit, seconds, flops, hbm_bytes, bound)."""
    return tuple((r.name, r.unit, r.seconds, r.flops, r.hbm_bytes, r.bound) for r in records)
