"""Data parallelism as a device program: any ``Model`` on a ``{data: N}`` mesh.

Every device holds the whole model (parameters, optimizer state and model
state such as BatchNorm's running averages) and trains on its slice of the
global batch. The gradients are allreduced over ``data`` in buckets, as XLA's
all-reduce combiner merges small all-reduces and issues each as soon as the
backward pass has produced it ([SB] "How to Scale Your Model", training
chapter; :func:`combine_buckets`): bucket ``k`` holds the gradients
of consecutive layers in backward order, and its call's ``after_record`` is
the end of the last record of its layers, so the clock (``pod.report.clock``)
lays it behind the rest of the backward pass. Then every device scales the sum
by 1 / data (``grad_mean``: the first op of the update) and runs the
optimizer on its own replica. The same bytes in give the same bytes out, so
the replicas stay bit-identical (``Pod.replicas_identical`` checks it).

BatchNorm's running averages move with each device's own shard (as Keras'
``MirroredStrategy`` keeps them per replica); an evaluation first allreduces
them over ``data`` and takes their mean (Keras reads a sync-on-read MEAN
variable so), then evaluates each device's slice of the test set.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from pod.memory import DeviceMemory
from pod.programs.collectives import AXES, DeviceCollectives
from pod.programs.contract import DeviceCoords, DeviceShard, EvalSums, StepResult
from pod.programs.memory import Phase, compute_bytes, peak_memory
from pod.workloads.layers import timing_zeros, vector_op
from pod.workloads.model import Model
from pod.workloads.optimizers import Optimizer

__all__ = ["ReplicatedProgram", "layer_ends", "combine_buckets"]

_F32 = np.float32
#: Bytes of the MXU's copy of a weight per precision: bf16 and int8 matmuls read a copy of
#: the float32 weights in their dtype; fp32 reads the float32 master itself.
_MXU_COPY_BYTES = {"bf16": 2, "int8": 1, "fp32": 0}
#: examples a device evaluates per forward pass (bounds the activations' memory)
EVAL_BATCH = 512


def combine_buckets(layers: Sequence[tuple[str, int]], max_elements: int
                    ) -> tuple[tuple[tuple[str, ...], int], ...]:
    """Combine consecutive layers' gradients into allreduce buckets, as XLA's
    all-reduce combiner merges small all-reduces.

    Args:
        layers: (layer, elements) in the order the backward pass finishes them
            (``Model.gradient_buckets``).
        max_elements: a bucket holds at most this many elements, unless a single
            layer is larger (it is a bucket of its own).

    Returns:
        ((layers, elements), ...) in the same order; every layer in exactly one.
    """
    out: list[tuple[tuple[str, ...], int]] = []
    names: list[str] = []
    total = 0
    for name, elements in layers:
        if names and total + elements > max_elements:
            out.append((tuple(names), total))
            names, total = [], 0
        names.append(name)
        total += elements
    if names:
        out.append((tuple(names), total))
    return tuple(out)


def layer_ends(records: Sequence, names: Iterable[str]) -> dict[str, int]:
    """Per layer name, the index just after its last op record (records are named
    ``<layer>/<op>``; a layer with no record maps to 0).

    The backward pass finishes a layer's gradients with its last record, so a
    bucket of layers is ready at the largest of its layers' ends.
    """
    ends = dict.fromkeys(names, 0)
    for i, rec in enumerate(records):
        layer = rec.name.split("/", 1)[0]
        if layer in ends:
            ends[layer] = i + 1
    return ends


class ReplicatedProgram:
    """The device program of data parallelism (module docstring).

    Args:
        model: any ``pod.workloads.Model`` (named or custom).
        sizes: axis name -> size; only ``data`` may be above 1.
        optimizer: the optimizer every replica runs.
        buckets: the gradient buckets, ((layer names), elements) in the order
            the backward pass finishes them (``combine_buckets``); None: one
            bucket of every layer, issued when the backward pass is done (no
            overlap).

    Raises:
        ValueError: an fsdp or tensor axis above 1, an unknown axis, or buckets
            that do not cover every layer with parameters exactly once.
    """

    def __init__(self, model: Model, sizes: Mapping[str, int], optimizer: Optimizer, *,
                 buckets: Sequence[tuple[Sequence[str], int]] | None = None):
        for name, size in sizes.items():
            if name not in AXES or int(size) < 1:
                raise ValueError(f"mesh axis {name!r} of size {size!r}: axes are "
                                 f"{', '.join(AXES)}, sizes >= 1")
        self.sizes = {a: int(sizes.get(a, 1)) for a in AXES}
        if any(self.sizes[a] > 1 for a in AXES if a != "data"):
            raise ValueError(f"{model.name} is replicated (data parallel): mesh "
                             f"{self.sizes} must have every axis but data 1")
        self.model, self.optimizer = model, optimizer
        keys = {layer.name: [k for k, _ in layer_keys]
                for layer, layer_keys in zip(model.layers, model.layer_param_keys(), strict=True)}
        if buckets is None:
            buckets = ((tuple(name for name, _ in model.gradient_buckets()), model.num_params),)
        self.buckets = tuple((tuple(layers), [k for layer in layers for k in keys[layer]])
                             for layers, _ in buckets)
        covered = sorted(k for _, ks in self.buckets for k in ks)
        if covered != sorted(model.param_shapes):
            raise ValueError(f"gradient buckets cover {len(covered)} parameters of "
                             f"{len(model.param_shapes)}; every one exactly once")

    @property
    def data(self) -> int:
        """Devices along data: the replicas."""
        return self.sizes["data"]

    @property
    def batch_shards(self) -> int:
        """Devices that see different examples: every replica."""
        return self.data

    # ------------------------------------------------------------ state

    def init_local(self, seed: int, coords: DeviceCoords) -> DeviceShard:
        """``model.init_params(seed)``, a fresh optimizer state and the initial model
        state: every replica starts identical."""
        params = self.model.init_params(seed)
        return DeviceShard(coords, params, self.optimizer.init(params), self.model.init_state())

    def shape_shard(self, coords: DeviceCoords = DeviceCoords()) -> DeviceShard:
        """A timing-only replica: zero views of every parameter and optimizer slot."""
        params = {k: timing_zeros(tuple(s), _F32) for k, s in self.model.param_shapes.items()}
        state = {f"{k}/{slot}": v for k, v in params.items() for slot in self.optimizer.slots}
        return DeviceShard(coords, params, state, self.model.init_state())

    def load_local(self, params: Mapping[str, np.ndarray], opt_state: Mapping[str, np.ndarray],
                   coords: DeviceCoords, model_state: Mapping[str, np.ndarray] | None = None
                   ) -> DeviceShard:
        """A replica holding copies of whole-model arrays (a checkpoint's).

        Raises:
            ValueError: parameters whose names or shapes do not fit the model.
        """
        shapes = self.model.param_shapes
        if set(params) != set(shapes) or any(np.shape(params[k]) != tuple(shapes[k])
                                             for k in shapes):
            raise ValueError("checkpoint parameters do not fit this model")
        return DeviceShard(coords, {k: np.array(params[k], _F32, copy=True) for k in shapes},
                           {k: np.array(v, copy=True) for k, v in opt_state.items()},
                           {k: np.array(v, copy=True)
                            for k, v in (model_state or self.model.init_state()).items()})

    def assemble(self, shards: Iterable[DeviceShard], *, opt_state: bool = False
                 ) -> dict[str, np.ndarray]:
        """The whole model's parameters (or optimizer state): data replica 0's.

        Raises:
            ValueError: no shard of replica 0 among ``shards``.
        """
        for shard in shards:
            if shard.coords.data == 0:
                return dict(shard.opt_state if opt_state else shard.params)
        raise ValueError("assemble needs the shard of data replica 0")

    # ------------------------------------------------------------ memory

    def memory(self, per_device_batch: int, precision: str = "bf16", *,
               prefetch_layers: int = 0) -> DeviceMemory:
        """One replica's HBM in a training step: the whole model's parameters (float32,
        or the model's ``weight_dtype``), its gradients and its optimizer state; the
        activations ``per_device_batch`` examples keep for backward in the precision's
        dtype (``Model.activation_memory``); as workspace, the MXU's copy of the weights
        of two layers (the one computing and the next: ``Model.largest_layer_params``
        each, 2 bytes under bf16, 1 under int8, none under fp32). Nothing is gathered:
        ``prefetch_layers`` is ignored.

        Raises:
            ValueError: an unknown precision, a negative batch.
        """
        if int(per_device_batch) < 0:
            raise ValueError(f"per_device_batch {per_device_batch} must be >= 0")
        compute_bytes(precision)                                          # checks it
        w = self.model.storage_dtype.itemsize
        params = int(self.model.num_params)
        acts = self.model.activation_memory(int(per_device_batch), precision=precision)
        assert acts is not None  # one device: no tensor split to refuse
        copy = 2 * self.model.largest_layer_params() * _MXU_COPY_BYTES[precision]
        step = Phase("step", w * params, acts.device_bytes, (("MXU weight copies", copy),))
        return peak_memory(w * params, len(self.optimizer.slots) * w * params, [step],
                           host_activations_bytes=acts.host_bytes)

    # ------------------------------------------------------------ batches

    def batch_slice(self, global_batch: int, coords: DeviceCoords) -> slice:
        """Replica ``coords.data``'s equal part of a global batch.

        Raises:
            ValueError: the global batch does not split evenly over data.
        """
        if global_batch % self.data:
            raise ValueError(f"global batch {global_batch} does not split over data = "
                             f"{self.data} devices")
        per = global_batch // self.data
        return slice(coords.data * per, (coords.data + 1) * per)

    def eval_slice(self, num_examples: int, coords: DeviceCoords) -> slice:
        """Replica ``coords.data``'s part of an evaluation set: every example is
        evaluated once (``np.array_split`` bounds; parts differ by at most one)."""
        base, extra = divmod(int(num_examples), self.data)
        start = coords.data * base + min(coords.data, extra)
        return slice(start, start + base + (coords.data < extra))

    def counts_eval(self, coords: DeviceCoords) -> bool:
        """Every replica evaluates different examples."""
        return True

    # ------------------------------------------------------------ the step

    def train_step(self, core, comm: DeviceCollectives, shard: DeviceShard, x: np.ndarray,
                   y: np.ndarray, step: int, *, rng=None) -> StepResult:
        """Forward and backward on this replica's examples, the gradient buckets
        allreduced over data, the mean, the optimizer.

        Args:
            core: the device's TensorCore (its records indexed from the step's start).
            comm: the device's collectives.
            shard: the replica's state.
            x: (b, *input_shape) its examples (:meth:`batch_slice`).
            y: (b,) or (b, T) labels.
            step: the optimizer step, 1 for the first.
            rng: numpy Generator of the dropout masks (a model with dropout needs it).

        Returns:
            The replica's loss, its new shard and where the update's records start.
        """
        loss, grads, state = self.model.loss_grads_and_state(core, shard.params, x, y,
                                                             state=dict(shard.model_state), rng=rng)
        ends = layer_ends(core.records, (name for layers, _ in self.buckets for name in layers))
        reduced = []
        for layers, keys in self.buckets:
            ready = max(ends[name] for name in layers)
            buf = self._flat(core, [grads[k] for k in keys])
            reduced.append(comm.allreduce("data", buf, tag=f"{layers[0]} grads",
                                          kind="grad_reduce",
                                          after_record=max(ready, _last_after(comm))))
        update_start = len(core.records)
        total = self._flat(core, reduced)
        mean = vector_op(core, "grad_mean", np.multiply, total, _F32(1.0 / self.data),
                         out=(total.shape, _F32))
        params, opt_state = self.optimizer.update(core, self._unflat(core, mean), shard.opt_state,
                                                  shard.params, step)
        return StepResult(float(loss), DeviceShard(shard.coords, params, opt_state, state),
                          update_start)

    def _flat(self, core, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """Arrays concatenated into one float32 buffer (a zero view when timing-only)."""
        n = sum(int(np.size(a)) for a in arrays)
        if not core.execute:
            return timing_zeros((n,), _F32)
        return np.concatenate([np.ravel(a).astype(_F32, copy=False) for a in arrays])

    def _unflat(self, core, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The reduced buffer cut back into the model's arrays, in bucket order."""
        shapes = self.model.param_shapes
        keys = [k for _, ks in self.buckets for k in ks]
        if not core.execute:
            return {k: timing_zeros(tuple(shapes[k]), _F32) for k in keys}
        out, start = {}, 0
        for k in keys:
            n = math.prod(shapes[k])
            out[k] = flat[start:start + n].reshape(shapes[k])
            start += n
        return {k: out[k] for k in shapes}

    # ------------------------------------------------------------ evaluation

    def evaluate(self, core, comm: DeviceCollectives, shard: DeviceShard, x: np.ndarray,
                 y: np.ndarray) -> EvalSums:
        """Eval-mode sums over this replica's examples (:meth:`eval_slice`), on the mean
        of every replica's model state (allreduced over data first, when the model
        has state)."""
        state = dict(shard.model_state)
        if state:
            keys = list(self.model.state_shapes)
            flat = np.concatenate([np.ravel(state[k]).astype(_F32) for k in keys])
            total = comm.allreduce("data", flat, tag="model state", kind="grad_reduce",
                                   after_record=len(core.records))
            mean, start = total / _F32(self.data), 0
            for k in keys:
                n = int(np.size(state[k]))
                state[k] = mean[start:start + n].reshape(np.shape(state[k]))
                start += n
        out = EvalSums(0.0, 0, 0)
        for start in range(0, x.shape[0], EVAL_BATCH):
            s, c, n = self.model.evaluate_sums(core, shard.params, x[start:start + EVAL_BATCH],
                                               y[start:start + EVAL_BATCH], state=state or None)
            out = out + EvalSums(float(s), int(c), int(n))
        return out


def _last_after(comm: DeviceCollectives) -> int:
    """The ``after_record`` of the device's last collective call (calls must not go back)."""
    calls = getattr(comm, "calls", None)
    return calls[-1].after_record if calls else 0
