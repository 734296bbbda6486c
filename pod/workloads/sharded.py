"""The SPMD program every device of a ``{data, fsdp, tensor}`` mesh runs to train the transformer.

One :class:`ShardedTransformer` serves every device; a device's state is a
:class:`DeviceShard` (its parameter and optimizer-state shards) and its
exchanges go through a ``pod.workloads.collectives.DeviceCollectives``. The
layout (JAX ``NamedSharding`` terms; [MEG] Shoeybi et al. 2019, "Megatron-LM";
[ZeRO] Rajbhandari et al. 2020; [SB] "How to Scale Your Model"):

- **tensor** [MEG]: each block's attention heads and MLP hidden units are
  split over the tensor devices: query / key / value and the MLP input
  projections column-parallel (a device holds the columns of its heads or
  hidden units), the attention output projection and the MLP output
  projection row-parallel (the rows of the same heads / units), so a device
  computes a partial sum of each block output. One allreduce over ``tensor``
  after the attention and one after the MLP in forward; in backward one of
  the MLP's and one of the attention's input gradient (Megatron's f / g
  operators). Everything else is replicated over ``tensor`` and computed
  redundantly by every tensor device: the norms, the token embedding and the
  unembedding (logits over the whole vocabulary), the loss. Their gradients
  come out identical on every tensor device, so no gradient crosses the
  tensor axis. Needs ``heads`` and ``mlp_dim`` divisible by the tensor size
  (:func:`check_tensor_split`).
- **sequence parallelism** (``sequence_parallel=True``; [SP] Korthikanti et
  al. 2022): outside the attention and MLP products a tensor device keeps
  only its chunk of the sequence (T / tensor positions): the norms, the
  residual adds, the final norm, the logits and the loss run on the chunk.
  Each allreduce becomes a reduce-scatter over the sequence after the
  row-parallel part and an all-gather before the column-parallel part (the
  same bytes on a ring, the norms' work and activations split); backward
  has their transposes. The embedding looks up the whole sequence and keeps
  the chunk. The replicated parameters (norms, embedding, unembedding) now
  see different tokens on each tensor device: their gradient chunks are
  allreduced over ``tensor`` too. Needs T divisible by the tensor size.
- **fsdp** [ZeRO] (ZeRO-3): every parameter's tensor-local array is
  flattened, zero-padded to a multiple of the fsdp size and split into equal
  chunks; device ``f`` keeps chunk ``f`` and the optimizer state of that chunk
  only. A layer all-gathers its parameters (one buffer per layer) before its
  forward and again before its backward (the gathered copy is not kept
  between the passes), and reduce-scatters its gradients when its backward is
  done. The token embedding's backward does not read the table, so it is not
  gathered there; a tied output layer gathers the embedding table itself.
- **data**: after the reduce-scatter, each gradient shard is allreduced over
  ``data``; then scaled by 1 / (data x fsdp) (times 1 / tensor with sequence
  parallelism), the number of token shards (as the data-parallel runtime's
  ``grad_mean``).
- **batch**: the global batch is split over data x fsdp (:meth:`batch_slice`);
  the tensor devices of a group get the same examples (and, with sequence
  parallelism, take their chunk of the positions themselves). Each device's
  loss is the mean over its tokens; the global loss is the mean over every
  device (:meth:`ShardedTransformer.global_loss`; every device's mean is
  over the same number of tokens), which equals the single-device mean over
  the global batch.

Per training step a layer with parameters issues (closed forms the tests
check, ``L`` blocks): fsdp all-gathers: every layer with parameters in
forward (embed, L blocks, final_norm, unembed), and in backward all of them
but the embedding (``2 L + 5``); fsdp reduce-scatters and data allreduces:
one per layer owning parameters (``L + 2``, ``L + 3`` with an untied output
layer); tensor activation allreduces of ``B T C`` float32 each (B the
per-device batch): 2 per block in forward, 2 in backward, plus 1 when remat
does not keep the summed attention output (``full``: backward recomputes
it); a parallel block 1 each way (``TransformerBlock.tensor_hook_calls``
lists a block's). With sequence parallelism: per block 2
all-gathers (``B T C / tensor`` float32 in) and 2 reduce-scatters (``B T C``
in) in forward, as many in backward, plus the recomputation's all-gathers
of the attention and MLP inputs (``minimal``: 2) and, under ``full``, the
attention output's reduce-scatter; and one gradient allreduce over tensor
per layer with replicated parameters. An axis of size 1 issues nothing;
:meth:`ShardedTransformer.planned_calls` lists them all.

Remat policies work unchanged (``TransformerBlock`` takes the tensor
operators as ``TensorHooks``). The core must emulate numerics (``TensorCore(numerics=True)``): every
exchanged buffer is float32. No dropout in this model, so a step needs no
random seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from chip import to_bf16
from pod.workloads.collectives import AXES, CollectiveCall, DeviceCollectives
from pod.workloads.layers import vector_op
from pod.workloads.optimizers import Optimizer
from pod.workloads.transformer import (
    TensorHooks,
    TransformerBlock,
    TransformerConfig,
    TransformerModel,
)

__all__ = ["DeviceCoords", "DeviceShard", "ParamLayout", "StepResult", "ShardedTransformer",
           "check_tensor_split", "device_param_elements", "flat_chunk", "pack_chunks", "param_layout",
           "unpack_gathered"]

_F32_BYTES = 4


@dataclass(frozen=True, order=True)
class DeviceCoords:
    """A device's place in the mesh: its position along each axis (ring order,
    ``DeviceCollectives.axis_index``)."""

    data: int = 0
    fsdp: int = 0
    tensor: int = 0

    @classmethod
    def of(cls, comm: DeviceCollectives) -> DeviceCoords:
        """The coordinates ``comm`` reports."""
        return cls(*(comm.axis_index(a) for a in AXES))


@dataclass(frozen=True)
class DeviceShard:
    """What one device keeps between steps.

    Attributes:
        coords: the device's coordinates.
        params: model key -> this device's chunk, 1-D float32 of
            ``ceil(n / fsdp)`` elements, n the size of the key's tensor-local
            array (padding zeros at the end of the last chunk).
        opt_state: the optimizer's state of those chunks, keyed as
            ``Optimizer.init`` keys it ("<key>/<slot>").
    """

    coords: DeviceCoords
    params: Mapping[str, np.ndarray]
    opt_state: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter of the whole model lives on the mesh.

    Attributes:
        layer: the layer that owns it (``TransformerModel.layers`` name).
        key: the parameter key ("block0/attention/wq").
        shape: its whole-model shape.
        tensor_dim: the dimension split over ``tensor`` (column-parallel: the
            output dimension; row-parallel: the input one), None if replicated
            over tensor.
        local_shape: its shape on one tensor device.
        device_elements: the elements of its chunk on one device,
            ``ceil(prod(local_shape) / fsdp)`` (:func:`flat_chunk`: flattened, then
            split over ``fsdp``, the last chunk zero-padded).
    """

    layer: str
    key: str
    shape: tuple[int, ...]
    tensor_dim: int | None
    local_shape: tuple[int, ...]
    device_elements: int


@dataclass(frozen=True)
class StepResult:
    """One device's training step.

    Attributes:
        loss: the mean loss over this device's tokens (float);
            :meth:`ShardedTransformer.global_loss` combines the devices'.
        shard: the updated DeviceShard.
        update_start: index in ``core.records`` (counted from the step's
            start, as ``after_record``) of the optimizer's first op: what
            comes from there on waits for every gradient collective.
    """

    loss: float
    shard: DeviceShard
    update_start: int


def check_tensor_split(config: TransformerConfig, tensor: int) -> None:
    """Checks that ``tensor`` devices can split the query heads, the key / value
    heads and the MLP hidden units.

    Raises:
        ValueError: one line, e.g. ``tensor 3 does not divide the transformer's
            heads 4, kv_heads 4 and mlp_dim 32; tensor must divide all three: 1,
            2, 4``.
    """
    sizes = (config.heads, config.kv_heads, config.mlp_dim)
    if all(n % tensor == 0 for n in sizes):
        return
    common = math.gcd(*sizes)
    choices = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
    raise ValueError(f"tensor {tensor} does not divide the transformer's heads {config.heads}, "
                     f"kv_heads {config.kv_heads} and mlp_dim {config.mlp_dim}; tensor must "
                     f"divide all three: {choices}")


def param_layout(model: TransformerModel, sizes: Mapping[str, int]) -> list[ParamLayout]:
    """``ShardedTransformer.param_layout`` of ``model`` on a mesh of these axis sizes
    (the layout does not depend on the optimizer; SGD stands in).

    Raises:
        ValueError: as :class:`ShardedTransformer` (a bad axis, or tensor not
            dividing the heads and mlp_dim).
    """
    from pod.workloads.optimizers import build_optimizer

    return ShardedTransformer(model, sizes, build_optimizer("sgd")).param_layout()


def device_param_elements(model: TransformerModel, fsdp: int, tensor: int) -> int:
    """The parameters one device keeps on a mesh with these fsdp and tensor sizes:
    the tensor-split weights' share, the replicated ones (embeddings, norms) whole,
    every array's fsdp chunk with its padding (:func:`param_layout`). The data size
    does not matter.

    Raises:
        ValueError: tensor does not divide the heads and mlp_dim
            (:func:`check_tensor_split`).
    """
    return sum(p.device_elements for p in param_layout(model, {"fsdp": fsdp, "tensor": tensor}))


def flat_chunk(x: np.ndarray, parts: int, index: int) -> np.ndarray:
    """Chunk ``index`` of x flattened and zero-padded to ``parts * ceil(x.size / parts)``.

    Returns:
        (ceil(x.size / parts),) float32, a new array.
    """
    c = -(-x.size // parts)
    padded = np.zeros(parts * c, np.float32)
    padded[:x.size] = np.asarray(x, np.float32).reshape(-1)
    return padded[index * c:(index + 1) * c].copy()


def pack_chunks(arrays: Sequence[np.ndarray], parts: int) -> np.ndarray:
    """The reduce-scatter buffer of several arrays: for j in 0 .. parts-1, chunk j
    (:func:`flat_chunk`) of each array in turn, so that chunk j of the buffer
    is device j's piece of every array.

    Returns:
        (parts * sum(ceil(a.size / parts)),) float32.
    """
    chunks = [[flat_chunk(a, parts, j) for a in arrays] for j in range(parts)]
    return np.concatenate([c for row in chunks for c in row]) if arrays else np.zeros(0, np.float32)


def unpack_gathered(buffer: np.ndarray, shapes: Sequence[tuple[int, ...]],
                    parts: int) -> list[np.ndarray]:
    """Inverse of :func:`pack_chunks`: the arrays of ``shapes`` from ``parts``
    concatenated pieces (an all-gather of every device's chunks).

    Args:
        buffer: (parts * sum(c_i),) float32, c_i = ceil(prod(shape_i) / parts).
        shapes: the arrays' shapes.
        parts: devices the arrays are split over.

    Returns:
        The arrays, float32, padding dropped.
    """
    sizes = [math.prod(s) for s in shapes]
    widths = [-(-n // parts) for n in sizes]
    rows = buffer.reshape(parts, sum(widths))                            # (parts, sum c)
    out, start = [], 0
    for shape, n, c in zip(shapes, sizes, widths):
        out.append(rows[:, start:start + c].reshape(-1)[:n].reshape(shape))
        start += c
    return out


class _TensorCollectives(TensorHooks):
    """``TensorHooks`` over the tensor axis of a device's collectives (kind
    "activation", tags "<place> <phase>"): allreduce after the row-parallel
    parts; with sequence parallelism all-gather of the sequence chunks before
    the column-parallel parts and reduce-scatter after the row-parallel ones
    (device at position i holds chunk i of the sequence)."""

    def __init__(self, core, comm: DeviceCollectives, phase: str, sequence: bool):
        self.core, self.comm, self.phase, self.sequence = core, comm, phase, sequence
        self.size = comm.axis_size("tensor")

    def _kw(self, tag: str) -> dict:
        return {"tag": f"{tag} {self.phase}", "kind": "activation",
                "after_record": len(self.core.records)}

    def _allreduce(self, tag, v):
        return self.comm.allreduce("tensor", np.ascontiguousarray(v).reshape(-1),
                                   **self._kw(tag)).reshape(v.shape)

    def _gather(self, tag, v):                                            # (B, t, C) -> (B, T, C)
        b, t, c = v.shape
        full = self.comm.all_gather("tensor", np.ascontiguousarray(v).reshape(-1), **self._kw(tag))
        return full.reshape(self.size, b, t, c).transpose(1, 0, 2, 3).reshape(b, self.size * t, c)

    def _scatter(self, tag, v):                                           # (B, T, C) -> (B, t, C)
        b, t, c = v.shape[0], v.shape[1] // self.size, v.shape[2]
        buf = np.ascontiguousarray(v.reshape(b, self.size, t, c).transpose(1, 0, 2, 3))
        return self.comm.reduce_scatter("tensor", buf.reshape(-1), **self._kw(tag)).reshape(b, t, c)

    def enter(self, tag, x):
        return self._gather(tag, x) if self.sequence else x

    def leave(self, tag, y):
        return self._scatter(tag, y) if self.sequence else self._allreduce(tag, y)

    def enter_grad(self, tag, dx):
        return self._scatter(tag, dx) if self.sequence else self._allreduce(tag, dx)

    def leave_grad(self, tag, dy):
        return self._gather(tag, dy) if self.sequence else dy


class ShardedTransformer:
    """The device program of a transformer on a ``{data, fsdp, tensor}`` mesh.

    Args:
        model: the (whole) TransformerModel.
        sizes: axis name -> size (missing axes are 1).
        optimizer: the optimizer (``pod.workloads.optimizers``); it updates the
            local chunks only (its arithmetic is elementwise, so a chunk's update
            is the whole model's restricted to the chunk).

    Attributes:
        model, optimizer: as given.
        sizes: {"data", "fsdp", "tensor"} -> size.
        local_model: the TransformerModel of one tensor device (heads / tensor
            heads, mlp_dim / tensor hidden units); its layers run the step.

    Raises:
        ValueError: an unknown axis or a size < 1; tensor not dividing heads
            and mlp_dim (:func:`check_tensor_split`).
    """

    def __init__(self, model: TransformerModel, sizes: Mapping[str, int], optimizer: Optimizer,
                 *, sequence_parallel: bool = False):
        for name, size in sizes.items():
            if name not in AXES or int(size) < 1:
                raise ValueError(f"mesh axis {name!r} of size {size!r}: axes are "
                                 f"{', '.join(AXES)}, sizes >= 1")
        self.model, self.optimizer = model, optimizer
        self.sizes = {a: int(sizes.get(a, 1)) for a in AXES}
        self.data, self.fsdp, self.tensor = (self.sizes[a] for a in AXES)
        cfg = model.config
        check_tensor_split(cfg, self.tensor)
        self.sequence_parallel = bool(sequence_parallel) and self.tensor > 1
        if self.sequence_parallel and cfg.sequence_length % self.tensor:
            raise ValueError(f"sequence parallelism: tensor {self.tensor} does not divide the "
                             f"sequence length {cfg.sequence_length}")
        self.local_model = TransformerModel(cfg.tensor_local(self.tensor))
        self._keys = self.local_model.layer_param_keys()
        self._split = {key: layer.tensor_split.get(local)
                       for layer, keys in zip(self.local_model.layers, self._keys)
                       for key, local in keys}
        owner: dict[str, int] = {}
        for i, keys in enumerate(self._keys):
            for key, _ in keys:
                owner.setdefault(key, i)
        self._owned = [[k for k, _ in keys if owner[k] == i] for i, keys in enumerate(self._keys)]
        self._shapes = self.local_model.param_shapes

    # ------------------------------------------------------------ layout

    @property
    def batch_shards(self) -> int:
        """Devices that see different examples: data x fsdp."""
        return self.data * self.fsdp

    @property
    def token_shards(self) -> int:
        """Devices that see different tokens: data x fsdp, times tensor with
        sequence parallelism (the gradients are scaled by its inverse)."""
        return self.batch_shards * (self.tensor if self.sequence_parallel else 1)

    def sequence_slice(self, coords: DeviceCoords) -> slice:
        """The positions of the sequence whose loss this device computes: all of
        them, or chunk ``coords.tensor`` with sequence parallelism."""
        if not self.sequence_parallel:
            return slice(None)
        t = self.model.config.sequence_length // self.tensor
        return slice(coords.tensor * t, (coords.tensor + 1) * t)

    @staticmethod
    def global_loss(losses: Iterable[float]) -> float:
        """The loss over the global batch from every device's :meth:`train_step`
        (or :meth:`evaluate`) loss: their mean. Every device's loss is a mean over
        the same number of tokens; without sequence parallelism the tensor
        devices of a group report the same bits, so they weigh alike."""
        values = [float(v) for v in losses]
        return sum(values) / len(values)

    def batch_slice(self, global_batch: int, coords: DeviceCoords) -> slice:
        """The examples of the global batch this device trains on.

        Raises:
            ValueError: the global batch does not split evenly over data x fsdp.
        """
        if global_batch % self.batch_shards:
            raise ValueError(f"global batch {global_batch} does not split over data x fsdp = "
                             f"{self.batch_shards} devices")
        per = global_batch // self.batch_shards
        s = coords.data * self.fsdp + coords.fsdp
        return slice(s * per, (s + 1) * per)

    def _param_of(self, name: str) -> str:
        """The parameter a key names: itself, or "<param>" of an optimizer "<param>/<slot>"."""
        return name if name in self._shapes else name.rsplit("/", 1)[0]

    def shard_params(self, params: Mapping[str, np.ndarray], coords: DeviceCoords
                     ) -> dict[str, np.ndarray]:
        """A device's chunks of whole-model arrays: the tensor slice, then fsdp chunk
        ``coords.fsdp``, per key.

        Args:
            params: the whole model's parameters (``model.init_params``, a
                checkpoint), or an optimizer state of them ("<key>/<slot>" keys,
                shaped like the parameter).
            coords: the device's coordinates.

        Returns:
            The same keys -> 1-D float32 chunks.
        """
        out = {}
        for key, value in params.items():
            a = np.asarray(value, np.float32)
            axis = self._split[self._param_of(key)]
            if axis is not None:
                a = np.split(a, self.tensor, axis=axis)[coords.tensor]
            out[key] = flat_chunk(a, self.fsdp, coords.fsdp)
        return out

    def init_local(self, seed: int, coords: DeviceCoords) -> DeviceShard:
        """The device's shard of ``model.init_params(seed)`` and a fresh optimizer
        state for it, so that a sharded run starts where a single-device one does."""
        params = self.shard_params(self.model.init_params(seed), coords)
        return DeviceShard(coords, params, self.optimizer.init(params))

    def load_local(self, params: Mapping[str, np.ndarray], opt_state: Mapping[str, np.ndarray],
                   coords: DeviceCoords) -> DeviceShard:
        """The device's shard of a whole model's parameters and optimizer state (a
        checkpoint's, :meth:`assemble`'s output): the inverse of :meth:`assemble`, so a
        run resumed from it continues bit for bit (padding is zeros, as a run keeps it).

        Raises:
            KeyError, ValueError: arrays that do not fit this program's model.
        """
        return DeviceShard(coords, self.shard_params(params, coords),
                           self.shard_params(opt_state, coords))

    def assemble(self, shards: Iterable[DeviceShard], *, opt_state: bool = False
                 ) -> dict[str, np.ndarray]:
        """The whole model's parameters (or optimizer state) from the shards of one
        data replica; the inverse of :meth:`shard_params`.

        Args:
            shards: DeviceShards covering every (fsdp, tensor) pair with
                ``coords.data == 0`` (others are ignored), e.g. every device's.
            opt_state: assemble ``DeviceShard.opt_state`` instead of ``params``.

        Returns:
            key -> float32 array shaped as ``model.param_shapes`` (of the key's
            parameter for an optimizer state key).

        Raises:
            ValueError: a (fsdp, tensor) pair of data replica 0 is missing.
        """
        have = {(s.coords.fsdp, s.coords.tensor): (s.opt_state if opt_state else s.params)
                for s in shards if s.coords.data == 0}
        missing = [(f, t) for f in range(self.fsdp) for t in range(self.tensor) if (f, t) not in have]
        if missing:
            raise ValueError(f"assemble needs the shards of data replica 0, missing (fsdp, tensor) "
                             f"{missing}")
        out = {}
        for key in have[(0, 0)]:
            shape = self._shapes[self._param_of(key)]
            axis = self._split[self._param_of(key)]
            pieces = []
            for t in range(self.tensor if axis is not None else 1):
                flat = np.concatenate([have[(f, t)][key] for f in range(self.fsdp)])
                pieces.append(flat[:math.prod(shape)].reshape(shape))
            out[key] = pieces[0] if axis is None else np.concatenate(pieces, axis=axis)
        return out

    # ------------------------------------------------------------ memory

    def param_layout(self) -> list[ParamLayout]:
        """Every parameter's sharding, in layer order: its tensor split and the size
        of one device's chunk (the console's sharding table, ``describe``)."""
        whole = self.model.param_shapes
        out = []
        for layer, keys in zip(self.local_model.layers, self._owned):
            for key in keys:
                local = tuple(self._shapes[key])
                out.append(ParamLayout(layer=layer.name, key=key, shape=tuple(whole[key]),
                                       tensor_dim=self._split[key], local_shape=local,
                                       device_elements=-(-math.prod(local) // self.fsdp)))
        return out

    def local_param_bytes(self) -> int:
        """float32 bytes of one device's parameter chunks (the gradient chunks after
        the reduce-scatter are as large)."""
        return self._chunk_bytes(self._shapes)

    def optimizer_state_bytes(self) -> int:
        """float32 bytes of one device's optimizer state (slots x its chunks)."""
        return len(self.optimizer.slots) * self.local_param_bytes()

    def gathered_layer_bytes(self) -> int:
        """float32 bytes of the largest layer after its fsdp all-gather (tensor-local,
        padding included): the workspace FSDP adds."""
        return max(self.fsdp * self._chunk_bytes(k for k, _ in keys) for keys in self._keys)

    def planned_calls(self, per_device_batch: int) -> list[CollectiveCall]:
        """The collectives one :meth:`train_step` issues, in order, without running it
        (for timing-only runs at any size): the calls ``comm.calls`` records, with
        ``after_record`` -1 (no records exist).

        Args:
            per_device_batch: b, examples per device (global batch / (data x fsdp)).
        """
        out: list[CollectiveCall] = []

        def add(axis, op, nbytes, tag, kind):
            if self.sizes[axis] > 1:
                out.append(CollectiveCall(axis, op, nbytes, tag, kind, -1))

        def gather(i, phase):
            if self._keys[i]:
                add("fsdp", "all_gather", self._chunk_bytes(k for k, _ in self._keys[i]),
                    f"{self.local_model.layers[i].name} {phase}", "param_gather")

        layers = self.local_model.layers
        for i, layer in enumerate(layers):
            gather(i, "fwd")
            for call in self._block_calls(layer, per_device_batch, "fwd"):
                add(*call)
        for i in range(len(layers) - 1, -1, -1):
            layer = layers[i]
            if layer.backward_reads_params:
                gather(i, "bwd")
            for call in self._block_calls(layer, per_device_batch, "bwd"):
                add(*call)
            if self._owned[i]:
                shard_bytes = self._chunk_bytes(self._owned[i])
                add("fsdp", "reduce_scatter", self.fsdp * shard_bytes, f"{layer.name} grads",
                    "grad_reduce")
                add("data", "allreduce", shard_bytes, f"{layer.name} grads", "grad_reduce")
                replicated = [k for k in self._owned[i] if self._split[k] is None]
                if self.sequence_parallel and replicated:
                    add("tensor", "allreduce", self._chunk_bytes(replicated),
                        f"{layer.name} replicated grads", "grad_reduce")
        return out

    def _block_calls(self, layer, batch: int, phase: str) -> list[tuple]:
        """(axis, op, nbytes, tag, kind) of a block's tensor operators in a pass,
        in the order ``TransformerBlock`` calls them (none for other layers)."""
        if not isinstance(layer, TransformerBlock):
            return []
        cfg = self.model.config
        whole = _F32_BYTES * batch * cfg.sequence_length * cfg.embed_dim   # (b, T, C) float32
        ops = {"enter": ("all_gather", whole // self.tensor) if self.sequence_parallel else None,
               "leave": ("reduce_scatter", whole) if self.sequence_parallel else ("allreduce", whole)}
        ops["leave_grad"], ops["enter_grad"] = ops["enter"], ops["leave"]
        steps = layer.tensor_hook_calls(phase)
        return [("tensor", *ops[hook], f"{layer.name}/{place} {phase}", "activation")
                for hook, place in steps if ops[hook] is not None]

    def _chunk_bytes(self, keys: Iterable[str]) -> int:
        """float32 bytes of this device's chunks of ``keys``."""
        return _F32_BYTES * sum(-(-math.prod(self._shapes[k]) // self.fsdp) for k in keys)

    # ------------------------------------------------------------ the step

    def train_step(self, core, comm: DeviceCollectives, shard: DeviceShard, x: np.ndarray,
                   y: np.ndarray, step: int) -> StepResult:
        """One training step of one device: forward, loss, backward, gradient
        reduction and the optimizer update of the local chunks.

        Args:
            core: the device's ``chip.TensorCore`` (numerics emulated); it records
                the compute, ``comm.calls`` the collectives.
            comm: the device's collectives; its axis sizes must be ``sizes``.
            shard: the device's state; ``shard.coords`` must be ``DeviceCoords.of(comm)``.
            x: (b, T) token ids, b = global batch / (data x fsdp): the examples of
                :meth:`batch_slice`.
            y: (b, T) next-token labels.
            step: the optimizer step, 1 for the first.

        Returns:
            StepResult: this device's mean loss, its new shard, where the
            optimizer's records start.

        Raises:
            ValueError: comm or shard do not belong to this mesh or device.
        """
        self._check(comm, shard)
        out, caches = self._forward(core, comm, shard, x, "fwd", training=True)
        loss, dy = self.local_model.output_loss(core, out, y[:, self.sequence_slice(shard.coords)])
        grads = self._backward(core, comm, shard, caches, dy)
        update_start = len(core.records)
        params, state = self.optimizer.update(core, grads, shard.opt_state, shard.params, step)
        return StepResult(loss, DeviceShard(shard.coords, params, state), update_start)

    def evaluate(self, core, comm: DeviceCollectives, shard: DeviceShard, x: np.ndarray,
                 y: np.ndarray) -> float:
        """Eval-mode mean loss over this device's (x, y), with the collectives of a
        forward pass (tagged "eval"). The global figure is formed as in training."""
        self._check(comm, shard)
        out, _ = self._forward(core, comm, shard, x, "eval", training=False)
        return self.local_model.output_loss(core, out, y[:, self.sequence_slice(shard.coords)])[0]

    def _check(self, comm: DeviceCollectives, shard: DeviceShard) -> None:
        got = {a: comm.axis_size(a) for a in AXES}
        if got != self.sizes:
            raise ValueError(f"the collectives' mesh {got} is not the program's {self.sizes}")
        if DeviceCoords.of(comm) != shard.coords:
            raise ValueError(f"shard of {shard.coords} given to the device at "
                             f"{DeviceCoords.of(comm)}")

    def _hooks(self, core, comm: DeviceCollectives, phase: str) -> _TensorCollectives | None:
        """The blocks' tensor operators (None when tensor is 1: one device's code path)."""
        if self.tensor == 1:
            return None
        return _TensorCollectives(core, comm, phase, self.sequence_parallel)

    def _gather(self, core, comm: DeviceCollectives, shard: DeviceShard, i: int,
                phase: str) -> dict[str, np.ndarray]:
        """Layer i's tensor-local params, all-gathered over fsdp, MXU weights rounded
        to bf16 when ``core.numerics`` (as ``TransformerModel.prepare_params``)."""
        keys = self._keys[i]
        if not keys:
            return {}
        layer = self.local_model.layers[i]
        mine = np.concatenate([shard.params[k] for k, _ in keys])
        full = comm.all_gather("fsdp", mine, tag=f"{layer.name} {phase}", kind="param_gather",
                               after_record=len(core.records))
        arrays = unpack_gathered(full, [self._shapes[k] for k, _ in keys], self.fsdp)
        return {local: (to_bf16(a) if core.numerics and local in layer.matmul_params else a)
                for (_, local), a in zip(keys, arrays)}

    def _forward(self, core, comm, shard, x, phase, *, training):
        """Forward through the layers; with sequence parallelism the layers after
        the embedding see this device's sequence chunk only."""
        caches = []
        hooks = self._hooks(core, comm, phase)
        for i, layer in enumerate(self.local_model.layers):
            p = self._gather(core, comm, shard, i, phase)
            hook = {"tensor": hooks} if isinstance(layer, TransformerBlock) else {}
            x, cache = layer.forward(core, p, x, training=training, **hook)
            if i == 0 and self.sequence_parallel:
                x = x[:, self.sequence_slice(shard.coords)]                # (B, T / tensor, C)
            caches.append(cache)
        return x, caches

    def _backward(self, core, comm, shard, caches, dy) -> dict[str, np.ndarray]:
        """Backward through the layers, last first; a layer's gradients leave as
        chunks (:meth:`_reduce`) as soon as its backward is done."""
        layers = self.local_model.layers
        hooks = self._hooks(core, comm, "bwd")
        grads: dict[str, np.ndarray] = {}
        chunks: dict[str, np.ndarray] = {}
        for i in range(len(layers) - 1, -1, -1):
            layer = layers[i]
            p = self._gather(core, comm, shard, i, "bwd") if layer.backward_reads_params else {}
            hook = {"tensor": hooks} if isinstance(layer, TransformerBlock) else {}
            if i == 0 and self.sequence_parallel:  # the embedding saw the whole sequence
                full = np.zeros((dy.shape[0], self.model.config.sequence_length, dy.shape[2]),
                                dy.dtype)
                full[:, self.sequence_slice(shard.coords)] = dy
                dy = full
            dy, g = layer.backward(core, p, caches[i], dy, need_dx=i > 0, **hook)
            for key, local in self._keys[i]:
                grads[key] = g[local] if key not in grads else vector_op(
                    core, f"{layer.name}/tied_grad_sum", np.add, grads[key], g[local],
                    out=(g[local].shape, np.float32))
            chunks.update(self._reduce(core, comm, layer.name,
                                       {k: grads.pop(k) for k in self._owned[i]}))
        return chunks

    def _reduce(self, core, comm, name: str, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A layer's gradients -> this device's chunks of the global-batch mean:
        reduce-scatter over fsdp, allreduce over data, times 1 / (data x fsdp)."""
        if not grads:
            return {}
        buf = pack_chunks(list(grads.values()), self.fsdp)
        part = comm.reduce_scatter("fsdp", buf, tag=f"{name} grads", kind="grad_reduce",
                                   after_record=len(core.records))
        part = comm.allreduce("data", part, tag=f"{name} grads", kind="grad_reduce",
                              after_record=len(core.records))
        widths = [-(-g.size // self.fsdp) for g in grads.values()]
        if self.sequence_parallel and self.tensor > 1:  # replicated params saw a chunk each
            ends = np.cumsum(widths)
            mine = np.concatenate([np.arange(e - w, e) for k, w, e in zip(grads, widths, ends)
                                   if self._split[k] is None] or [np.zeros(0, int)])
            if mine.size:
                part = np.array(part)                                     # may be read-only
                part[mine] = comm.allreduce("tensor", part[mine], tag=f"{name} replicated grads",
                                            kind="grad_reduce", after_record=len(core.records))
        if self.token_shards > 1:
            scale = np.float32(1.0 / self.token_shards)
            part = core.vector(f"{name}/grad_mean", np.multiply, part, scale)
        return dict(zip(grads, np.split(part, np.cumsum(widths)[:-1])))
