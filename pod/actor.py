"""``ChipActor``: one emulated TPU chip, the thin Ray shell around ``chip.Chip``.

The class is plain Python so it can be exercised in-process; the coordinator
wraps it with ``ray.remote``. It holds one model replica (parameters and
optimizer state) per TensorCore, as a real chip does under data parallelism.

One training step, seen from a chip (see ../shared/DESIGN.md):

1. ``compute``: each TensorCore runs forward + backward on its shard; the
   chip then reduces its cores' gradients locally (an on-chip vector add,
   costed on core 0) into one flat float32 buffer.
2. ``run_collective`` (one call): run this chip's part of the allreduce
   schedule, sending chunks straight to the receiving chips and applying
   the ones it receives (``pod.ici``); the driver never handles gradient
   bytes. (``exchange``, once per phase with chunks as object-store
   references, is the earlier, slower transport.)
3. ``apply``: every core divides the sum by the number of replicas and runs
   the optimizer on its own replica. The same bytes in give the same bytes
   out, so replicas stay bit-identical (checked by ``digests``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import numpy as np

from chip import Chip, ChipSpec, OpRecord
from pod.workloads import Model, build_optimizer

__all__ = ["ChipActor", "flatten", "unflatten", "summarize_records"]


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


def summarize_records(records: Sequence[OpRecord]) -> dict[str, float]:
    """Totals of a list of op records.

    Returns:
        seconds (simulated, ops run back to back on one core), flops,
        mxu_flops, hbm_bytes, and seconds per unit (mxu_seconds, vpu_seconds,
        scalar_seconds).
    """
    totals = {"seconds": 0.0, "flops": 0, "mxu_flops": 0, "hbm_bytes": 0,
              "mxu_seconds": 0.0, "vpu_seconds": 0.0, "scalar_seconds": 0.0}
    for rec in records:
        totals["seconds"] += rec.seconds
        totals["flops"] += rec.flops
        totals["hbm_bytes"] += rec.hbm_bytes
        totals[f"{rec.unit}_seconds"] = totals.get(f"{rec.unit}_seconds", 0.0) + rec.seconds
        if rec.unit == "mxu":
            totals["mxu_flops"] += rec.flops
    return totals


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
        put_chunks: send chunks as objects this actor puts in Ray's object
            store (True inside a Ray actor); False returns plain arrays.
        precision: MXU precision of every core: "bf16", "fp32" or "int8"
            (the scenario's ``training.precision``).

    Raises:
        HBMOutOfMemoryError: the parameters, gradients or optimizer state do
            not fit in a core's HBM.
    """

    def __init__(self, spec: ChipSpec, chip_id: int, model: Model, optimizer_name: str,
                 optimizer_options: dict[str, Any], seed: int, num_replicas: int,
                 numerics: bool = True, limit_threads: bool = True,
                 put_chunks: bool = False, precision: str = "bf16") -> None:
        if limit_threads:
            from threadpoolctl import threadpool_limits
            threadpool_limits(1)
        self.chip = Chip(spec, chip_id, numerics=numerics, precision=precision)
        self.put_chunks = put_chunks
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
        """SHA-256 of each core's parameter bytes, in dict order."""
        out = []
        for params in self.params:
            h = hashlib.sha256()
            for v in params.values():
                h.update(np.ascontiguousarray(v).tobytes())
            out.append(h.hexdigest())
        return out

    def get_params(self, core: int = 0) -> dict[str, np.ndarray]:
        """A copy of one core's parameters."""
        return {k: v.copy() for k, v in self.params[core].items()}

    def get_model_state(self, core: int = 0) -> dict[str, np.ndarray]:
        """A copy of one core's model state (BatchNorm running averages; {} if none)."""
        return {k: v.copy() for k, v in self.model_state[core].items()}

    def get_opt_state(self, core: int = 0) -> dict[str, np.ndarray]:
        """A copy of one core's optimizer state."""
        return {k: v.copy() for k, v in self.opt_state[core].items()}

    def hbm(self) -> list[dict[str, int]]:
        """Per core: used_bytes, peak_bytes, capacity_bytes."""
        return [{"used_bytes": c.hbm.used_bytes, "peak_bytes": c.hbm.peak_bytes,
                 "capacity_bytes": c.hbm.capacity_bytes} for c in self.chip.cores]

    def set_compute_slowdown(self, factor: float) -> None:
        """Make this chip a straggler: its simulated forward + backward seconds (and
        their op records) are multiplied by ``factor`` >= 1 from the next step on.

        Raises:
            ValueError: factor < 1 or not finite.
        """
        if not (np.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"compute slowdown must be a finite factor >= 1, got {factor!r}")
        self.compute_slowdown = float(factor)

    def snapshot(self, full: bool = False) -> dict[str, Any]:
        """What a checkpoint needs from this chip.

        Args:
            full: also return core 0's parameters and optimizer state (the
                coordinator asks one chip; the others only send digests).

        Returns:
            ``digests``: per core [params sha256, optimizer state sha256];
            ``model_state``: per core, a copy of its model state; with full,
            ``params`` and ``optimizer_state`` of core 0.
        """
        out: dict[str, Any] = {
            "digests": [[d, _digest(o)] for d, o in zip(self.digests(), self.opt_state)],
            "model_state": [self.get_model_state(c) for c in range(len(self.chip.cores))],
        }
        if full:
            out["params"] = self.get_params(0)
            out["optimizer_state"] = self.get_opt_state(0)
        return out

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
                trace: bool = False) -> dict[str, Any]:
        """Forward + backward on every core, then the on-chip gradient reduce.

        Args:
            step: zero-based step number (seeds the dropout streams).
            x: this chip's examples, (B_chip, ...) float32; core i takes rows
                [i*b, (i+1)*b) with b = B_chip / cores.
            y: labels, (B_chip,) int64.
            seed: the scenario seed.
            trace: also return every op record (``records``, per core, and
                ``local_reduce_records``) for a timeline.

        Returns:
            Per core lists ``loss``, ``compute_seconds``, ``mxu_flops``,
            ``flops``, ``hbm_bytes``; ``local_reduce_seconds``; ``hbm`` (per
            core used / peak / capacity bytes).
        """
        cores = self.chip.cores
        b = x.shape[0] // len(cores)
        losses, totals, flats, traces = [], [], [], []
        for i, core in enumerate(cores):
            rng = np.random.default_rng([seed, step, self.chip_id, i])
            core.hbm.allocate("activations", self.model.activation_bytes(b))
            loss, grads, self.model_state[i] = self.model.loss_grads_and_state(
                core, self.params[i], x[i * b:(i + 1) * b], y[i * b:(i + 1) * b],
                state=self.model_state[i], rng=rng)
            core.hbm.free("activations")
            losses.append(float(loss))
            records = core.take_records()
            if self.compute_slowdown != 1.0:  # a straggler: its records take longer
                f = self.compute_slowdown
                records = [dataclasses.replace(r, seconds=r.seconds * f,
                                               compute_seconds=r.compute_seconds * f,
                                               memory_seconds=r.memory_seconds * f)
                           for r in records]
            totals.append(summarize_records(records))
            traces.append(_trace_rows(records) if trace else [])
            flats.append(flatten(grads))
        reducer = cores[0]
        acc = flats[0]
        for other in flats[1:]:
            acc = reducer.vector("local_reduce", np.add, acc, other)
        reduce_records = reducer.take_records()
        local = summarize_records(reduce_records)
        self.grad_flat = np.array(acc, dtype=np.float32, copy=True)
        return {
            "loss": losses,
            "compute_seconds": [t["seconds"] for t in totals],
            "mxu_flops": [t["mxu_flops"] for t in totals],
            "flops": [t["flops"] for t in totals],
            "hbm_bytes": [t["hbm_bytes"] for t in totals],
            "local_reduce_seconds": local["seconds"],
            "records": traces,
            "local_reduce_records": _trace_rows(reduce_records) if trace else [],
            "hbm": self.hbm(),
        }

    def exchange(self, receives: Sequence[tuple[int, bool]], sends: Sequence[int],
                 *incoming: Any) -> Any:
        """One allreduce phase: apply what arrived, then send this phase's chunks.

        Args:
            receives: (chunk, reduce) per incoming chunk, in the order of
                ``incoming``. reduce: ``buf[c] = buf[c] + chunk``; else copy.
            sends: chunk indices to send this phase.
            incoming: Ray object references to the chunks (put by their
                senders), or arrays when run in-process.

        Returns:
            One reference (or array in-process) per send; a single value when
            there is one send, None when there are none.
        """
        if incoming:
            arrays = _resolve(incoming)
            for (chunk, reduce), arr in zip(receives, arrays):
                start, stop = self.chunk_bounds[chunk]
                if reduce:
                    self.grad_flat[start:stop] = self.grad_flat[start:stop] + arr
                else:
                    self.grad_flat[start:stop] = arr
        outs = [self.grad_flat[slice(*self.chunk_bounds[c])].copy() for c in sends]
        if self.put_chunks:
            import ray
            outs = [ray.put(o) for o in outs]
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else tuple(outs)

    def ici_address(self, key: bytes = b"") -> tuple[str, int]:
        """(host, port) where this chip receives chunks from its peers (``pod.ici``;
        the port opens on first use, with the pod's link ``key``)."""
        return self._ici_port(key).address

    def run_collective(self, run_id: int, plan: Sequence[Any], peers: Sequence[int],
                       *addresses: tuple[str, int]) -> None:
        """Run this chip's part of an allreduce schedule, chip to chip (``pod.ici``).

        Args:
            run_id: the collective's id, the same on every chip.
            plan: this rank's phases (``pod.ici.RankPlan``).
            peers: the ranks this chip sends to, in the order of ``addresses``.
            addresses: their ``ici_address()`` (Ray resolves the references).
        """
        self._ici_port().run(run_id, plan, dict(zip(peers, addresses)), self.grad_flat,
                             self.chunk_bounds)

    def _ici_port(self, key: bytes = b"") -> Any:
        port = getattr(self, "_ici", None)
        if port is None:
            from pod.ici import IciPort
            port = self._ici = IciPort(self.chip_id, key)
        return port

    def apply(self, step: int, trace: bool = False) -> dict[str, Any]:
        """Average the allreduced gradients and update every core's replica.

        Args:
            step: zero-based step number (the optimizer counts from step + 1).
            trace: also return every op record per core (``records``).

        Returns:
            ``update_seconds`` per core (simulated) and ``hbm``.
        """
        seconds, traces = [], []
        scale = np.float32(1.0 / self.num_replicas)
        for i, core in enumerate(self.chip.cores):
            mean = core.vector("grad_mean", np.multiply, self.grad_flat, scale)
            grads = unflatten(mean, self.params[i])
            self.params[i], self.opt_state[i] = self.optimizer.update(
                core, grads, self.opt_state[i], self.params[i], step + 1)
            records = core.take_records()
            seconds.append(summarize_records(records)["seconds"])
            traces.append(_trace_rows(records) if trace else [])
        self.grad_flat = None
        return {"update_seconds": seconds, "hbm": self.hbm(), "records": traces}

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch: int = 512,
                 state: dict[str, np.ndarray] | None = None) -> dict[str, float]:
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
        return {"loss": loss_sum / n, "accuracy": correct / n}


def _digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 of arrays' raw bytes in dict order."""
    h = hashlib.sha256()
    for v in arrays.values():
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


def _trace_rows(records: Sequence[OpRecord]) -> list[tuple[str, str, float, int, int, str]]:
    """Op records as plain tuples (name, unit, seconds, flops, hbm_bytes, bound)."""
    return [(r.name, r.unit, r.seconds, r.flops, r.hbm_bytes, r.bound) for r in records]


def _resolve(items: Sequence[Any]) -> list[np.ndarray]:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return list(items)
    refs = [i for i in items if isinstance(i, ray.ObjectRef)]
    if not refs:
        return list(items)
    got = iter(ray.get(refs))
    return [next(got) if isinstance(i, ray.ObjectRef) else i for i in items]

