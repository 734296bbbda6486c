"""The SPMD program every device of a ``{data, fsdp, tensor}`` mesh runs to train the transformer.

One :class:`ShardedTransformer` serves every device; a device's state is a
``DeviceShard`` (its parameter and optimizer-state shards) and its exchanges
go through a ``pod.programs.collectives.DeviceCollectives``
(``pod.programs.contract`` is the contract). The layout (JAX ``NamedSharding``
terms; [MEG] Shoeybi et al. 2019, "Megatron-LM"; [ZeRO] Rajbhandari et al.
2020; [SB] "How to Scale Your Model"):

- **tensor** [MEG] (``pod.programs.tensor``): each block's attention heads and
  MLP hidden units are split over the tensor devices: query / key / value and
  the MLP input projections column-parallel, the attention output projection
  and the MLP output projection row-parallel, so a device computes a partial
  sum of each block output, allreduced over ``tensor`` (Megatron's f / g
  operators). Everything else is replicated over ``tensor``: the norms, the
  token embedding and the unembedding, the loss. Their gradients come out
  identical on every tensor device, so no gradient crosses the tensor axis,
  but for a scale the heads share (a qk norm's: a layer's ``tensor_partial``),
  whose gradient on a device covers its heads only: it is allreduced over
  ``tensor``. Needs ``heads`` and ``mlp_dim`` divisible by the tensor size
  (:func:`check_tensor_split`).
- **sequence parallelism** (``sequence_parallel=True``; [SP] Korthikanti et
  al. 2022): outside the attention and MLP products a tensor device keeps
  only its chunk of the sequence; each allreduce becomes a reduce-scatter
  over the sequence and an all-gather; the replicated parameters see
  different tokens on each tensor device, so their gradient chunks are
  allreduced over ``tensor`` too. Needs T divisible by the tensor size.
- **fsdp** [ZeRO] (ZeRO-3, ``pod.programs.fsdp``): every parameter's
  tensor-local array is cut into equal chunks, one per fsdp device, with its
  optimizer state. A layer all-gathers its parameters before its forward and
  again before its backward, and reduce-scatters its gradients when its
  backward is done. The token embedding's backward does not read the table,
  so it is not gathered there.
- **expert** ([GShard] Lepikhin et al. 2020; MaxText ``ici_expert_parallelism``;
  ``pod.programs.experts``): each MoE block's E experts are split over the
  ``expert`` devices, E / expert each, their weights chunked over fsdp like
  every parameter (expert parallelism inside, FSDP storage around it; no
  tensor split of an expert: a mesh with both experts and tensor > 1 is
  refused, :func:`check_expert_split`). Everything else (attention, norms,
  embeddings, routers) is replicated over ``expert``, as over ``data``, and
  the batch is split over it too (MaxText's ``activation_batch`` over data,
  fsdp and expert): each device routes its own tokens and an all-to-all over
  ``expert`` takes them to their experts' devices and back (dispatch and
  combine, twice more in backward). An expert's gradient sums its tokens
  from every device of the group through the all-to-alls; it is then
  reduce-scattered over fsdp and allreduced over data, the axes that
  replicate it; the replicated parameters' gradients are allreduced over
  ``expert`` as well. Dropless routing (capacity_factor 0) needs a ragged
  all-to-all and is refused with an expert axis. A dense model on an expert
  axis is data parallel over it.
- **data**: after the reduce-scatter, each gradient shard is allreduced over
  ``data``, then scaled by 1 / (data x fsdp x expert) (times 1 / tensor with
  sequence parallelism), the number of token shards.
- **batch**: the global batch is split over data x fsdp x expert
  (:meth:`batch_slice`); the tensor devices of a group get the same examples.

On a ``{data: N}`` mesh this is data parallelism. The gradients leave in the
buckets every data-parallel program uses (``buckets``: consecutive layers up to
``training.overlap_bucket_bytes``, ``pod.programs.combine_buckets``), each
issued as the backward pass finishes its last layer.

Per training step a layer with parameters issues (closed forms the tests
check, ``L`` blocks, with buckets of one layer each, the default): fsdp
all-gathers: every layer with parameters in forward (embed, L blocks,
final_norm, unembed), and in backward all of them but the embedding
(``2 L + 5``); fsdp reduce-scatters and data allreduces: one per layer owning
parameters (``L + 2``, ``L + 3`` with an untied output layer; one per bucket
with larger buckets); tensor activation allreduces of ``B T C`` in the wire dtype each (B the
per-device batch): 2 per block in forward, 2 in backward, plus 1 when remat
does not keep the summed attention output (``full``: backward recomputes
it); a parallel block 1 each way (``TransformerBlock.tensor_hook_calls``
lists a block's). With sequence parallelism: per block 2
all-gathers (``B T C / tensor`` float32 in) and 2 reduce-scatters (``B T C``
in) in forward, as many in backward, plus the recomputation's all-gathers
of the attention and MLP inputs (``minimal``: 2) and, under ``full``, the
attention output's reduce-scatter; and one gradient allreduce over tensor
per layer with replicated parameters. An axis of size 1 issues nothing.

Remat policies work unchanged (``TransformerBlock`` takes the tensor
operators as ``TensorHooks``). Every exchanged buffer is float32. On a
timing-only core (``core.execute`` False) the program records the same ops and
calls with the data movement that costs nothing left out: shards, gathered
layers, packed gradients and summed activations are read-only zero views
(:meth:`ShardedTransformer.shape_shard`), so a step of a 175B-class model
costs wall time in the number of ops, not in their sizes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chip import to_bf16
from pod.memory import DeviceMemory
from pod.programs.collectives import AXES, DeviceCollectives
from pod.programs.contract import DeviceCoords, DeviceShard, EvalSums, StepResult
from pod.programs.experts import ExpertCollectives
from pod.programs.fsdp import chunk_elements, flat_chunk, pack_chunks, unpack_gathered
from pod.programs.memory import (
    PREFETCH_LAYERS,
    Phase,
    backward_working_bytes,
    compute_bytes,
    gather_bytes,
    output_gradient_held,
    peak_memory,
)
from pod.programs.tensor import TensorCollectives, wire_itemsize
from pod.workloads.layers import timing_zeros, vector_op
from pod.workloads.optimizers import Optimizer
from pod.workloads.transformer import (
    TransformerBlock,
    TransformerConfig,
    TransformerModel,
    check_expert_split,
    check_tensor_split,
    moe_aux_loss,
    router_loads,
    shared_transformer,
)
from pod.workloads.weights import stored, weight_dtype

__all__ = ["ParamLayout", "ShardedTransformer", "check_tensor_split", "check_expert_split",
           "device_param_elements", "param_layout"]


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
        local_shape: its shape on one device before the fsdp chunking (tensor
            and expert splits applied).
        device_elements: the elements of its chunk on one device,
            ``ceil(prod(local_shape) / fsdp)`` (:func:`flat_chunk`: flattened, then
            split over ``fsdp``, the last chunk zero-padded).
        expert_dim: the dimension split over ``expert`` (an MoE's expert weights:
            0), None if replicated over expert.
    """

    layer: str
    key: str
    shape: tuple[int, ...]
    tensor_dim: int | None
    local_shape: tuple[int, ...]
    device_elements: int
    expert_dim: int | None = None


def param_layout(model: TransformerModel, sizes: Mapping[str, int]) -> list[ParamLayout]:
    """``ShardedTransformer.param_layout`` of ``model`` on a mesh of these axis sizes
    (the layout does not depend on the optimizer; SGD stands in).

    Raises:
        ValueError: as :class:`ShardedTransformer` (a bad axis, or tensor not
            dividing the heads and mlp_dim).
    """
    from pod.workloads.optimizers import build_optimizer

    return ShardedTransformer(model, sizes, build_optimizer("sgd")).param_layout()


def device_param_elements(model: TransformerModel, fsdp: int, tensor: int,
                          expert: int = 1) -> int:
    """The parameters one device keeps on a mesh with these fsdp, tensor and expert
    sizes: the tensor-split weights' share, E / expert of each MoE's experts, the
    replicated ones (embeddings, norms, routers) whole, every array's fsdp chunk with
    its padding (:func:`param_layout`). The data size does not matter.

    Raises:
        ValueError: tensor does not divide the heads and mlp_dim
            (:func:`check_tensor_split`), or expert the experts
            (:func:`check_expert_split`).
    """
    return _device_param_elements(model.config, int(fsdp), int(tensor), int(expert))


@functools.lru_cache(maxsize=4096)
def _device_param_elements(config: TransformerConfig, fsdp: int, tensor: int, expert: int) -> int:
    """:func:`device_param_elements` of the model of ``config``, kept per (config, fsdp,
    tensor, expert): an HBM plan that does not fit asks it of every mesh of its devices,
    and a layout search asks it again for every point (building the program is most of it)."""
    sizes = {"fsdp": fsdp, "tensor": tensor, "expert": expert}
    return sum(p.device_elements for p in param_layout(shared_transformer(config), sizes))


#: local model -> its layout (:func:`_model_layout`); the local models are shared
#: (``shared_transformer``), so are their layouts
_LAYOUTS: dict[int, tuple[Any, tuple[Any, ...]]] = {}


@dataclass(frozen=True)
class _Counts:
    """A device's chunk sizes on one (fsdp, tensor) of a tensor-local model, shared by
    every program of the model on it (pure functions of the shapes and sizes; a plan
    search builds thousands of programs of a few models): per key its chunk's elements
    (padded, ``chunk_elements``; every key of the model), per layer their sum (filled as
    asked), and the program's other sums of them by what they are of (``memo``)."""

    chunks: dict[str, int]
    layers: dict[int, int]
    memo: dict[Any, Any]


def _model_layout(local_model: TransformerModel) -> tuple[Any, ...]:
    """What ``ShardedTransformer`` reads of its tensor-local model, made once per model (a
    plan builds thousands of programs of a few models): per layer its (key, local name)
    parameters; key -> its tensor split; the keys replicated over tensor whose gradient
    covers a device's heads only; key -> its expert split (None: replicated); per layer
    the keys it owns (its first layer); key -> shape; the layers' names; key -> its first
    layer; (fsdp, tensor) -> the :class:`_Counts` of the model's programs there. Read only
    but for the counts, which only grow."""
    kept = _LAYOUTS.get(id(local_model))
    if kept is not None and kept[0] is local_model:
        return kept[1]
    keys = local_model.layer_param_keys()
    pairs = [(layer, key, local) for layer, layer_keys in zip(local_model.layers, keys,
                                                              strict=True)
             for key, local in layer_keys]
    split = {key: layer.tensor_split.get(local) for layer, key, local in pairs}
    # replicated over tensor, but each tensor device's gradient covers its heads only
    partial = {key for layer, key, local in pairs if local in layer.tensor_partial}
    # the experts' weights: split over expert on this dimension (None: replicated)
    expert_split = {key: getattr(layer, "expert_split", {}).get(local)
                    for layer, key, local in pairs}
    owner: dict[str, int] = {}
    for i, layer_keys in enumerate(keys):
        for key, _ in layer_keys:
            owner.setdefault(key, i)
    owned = [[k for k, _ in layer_keys if owner[k] == i] for i, layer_keys in enumerate(keys)]
    names = tuple(layer.name for layer in local_model.layers)
    key_layer = {k: i for i in reversed(range(len(keys))) for k, _ in keys[i]}  # its first
    counts: dict[tuple[int, int], _Counts] = {}  # (fsdp, tensor) -> _Counts, filled as asked
    layout = (keys, split, partial, expert_split, owned, local_model.param_shapes, names,
              key_layer, counts)
    if len(_LAYOUTS) >= 64:
        _LAYOUTS.clear()
    _LAYOUTS[id(local_model)] = (local_model, layout)
    return layout


class ShardedTransformer:
    """The device program of a transformer on a ``{data, fsdp, tensor}`` mesh.

    Args:
        model: the (whole) TransformerModel.
        sizes: axis name -> size (missing axes are 1).
        optimizer: the optimizer (``pod.workloads.optimizers``); it updates the
            local chunks only (its arithmetic is elementwise, so a chunk's update
            is the whole model's restricted to the chunk).
        sequence_parallel: Megatron sequence parallelism over tensor.
        buckets: the gradient buckets, ((layer names), elements) in the order the
            backward pass finishes them (``pod.programs.combine_buckets`` of
            ``model.gradient_buckets()``, as the replicated program takes them:
            ``training.overlap_bucket_bytes`` means the same for every model): a
            bucket's gradients are reduced (reduce-scatter over fsdp, allreduce over
            data, ...) as one buffer when the backward pass finishes its last layer.
            None: each layer with parameters its own bucket.

    Attributes:
        model, optimizer: as given.
        sizes: {"data", "fsdp", "tensor"} -> size.
        local_model: the TransformerModel of one tensor device (heads / tensor
            heads, mlp_dim / tensor hidden units); its layers run the step.

    Raises:
        ValueError: an unknown axis or a size < 1; tensor not dividing heads
            and mlp_dim (:func:`check_tensor_split`); buckets that do not hold every
            layer with parameters exactly once.
    """

    def __init__(self, model: TransformerModel, sizes: Mapping[str, int], optimizer: Optimizer,
                 *, sequence_parallel: bool = False,
                 buckets: Sequence[tuple[Sequence[str], int]] | None = None):
        for name, size in sizes.items():
            if name not in AXES or int(size) < 1:
                raise ValueError(f"mesh axis {name!r} of size {size!r}: axes are "
                                 f"{', '.join(AXES)}, sizes >= 1")
        self.model, self.optimizer = model, optimizer
        self.sizes = {a: int(sizes.get(a, 1)) for a in AXES}
        self.data, self.fsdp, self.tensor = (self.sizes[a] for a in ("data", "fsdp", "tensor"))
        self.expert = self.sizes["expert"]
        if self.sizes["stage"] > 1:
            raise ValueError(f"mesh axis stage of size {self.sizes['stage']}: the transformer "
                             "program runs on data, fsdp, expert and tensor axes")
        cfg = model.config
        check_tensor_split(cfg, self.tensor)
        check_expert_split(cfg, self.sizes)
        self.sequence_parallel = bool(sequence_parallel) and self.tensor > 1
        if self.sequence_parallel and cfg.sequence_length % self.tensor:
            raise ValueError(f"sequence parallelism: tensor {self.tensor} does not divide the "
                             f"sequence length {cfg.sequence_length}")
        self.local_model = shared_transformer(cfg.tensor_local(self.tensor),
                                              self.expert if cfg.experts else 1)
        (self._keys, self._split, self._partial, self._expert_split, self._owned,
         self._shapes, self._layer_names, self._key_layer, counts) = _model_layout(
            self.local_model)
        self.buckets = self._check_buckets(buckets)
        self._bucket_ends = {layers[-1]: layers[0] for layers, _ in self.buckets}
        # per key, this device's chunk's elements, and per layer their sum (``_chunk_count``,
        # asked per layer and gather): shared by the programs of the local model and sizes
        shared = counts.get((self.fsdp, self.tensor))
        if shared is None:
            shared = counts[(self.fsdp, self.tensor)] = _Counts(
                {k: chunk_elements(math.prod(s), self.fsdp) for k, s in self._shapes.items()},
                {}, {})
        self._counts = shared
        self._chunks: dict[str, int] = shared.chunks
        self._layer_chunks: dict[int, int] = shared.layers
        self._zero_params: dict[int, dict[str, np.ndarray]] = {}  # timing-only gathers
        #: the dtype the chunks, their gradients and the optimizer state are stored in
        #: (``weight_dtype``: float32, or bf16)
        self.storage = weight_dtype(cfg.weight_dtype)

    # ------------------------------------------------------------ layout

    @property
    def batch_shards(self) -> int:
        """Devices that see different examples: data x fsdp x expert."""
        return self.data * self.fsdp * self.expert

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
        """The examples of the global batch this device trains on (shard
        ``(data x fsdp + fsdp) x expert + expert``, data outermost).

        Raises:
            ValueError: the global batch does not split evenly over data x fsdp x expert.
        """
        if global_batch % self.batch_shards:
            axes = "data x fsdp" + (" x expert" if self.expert > 1 else "")
            raise ValueError(f"global batch {global_batch} does not split over {axes} = "
                             f"{self.batch_shards} devices")
        per = global_batch // self.batch_shards
        s = (coords.data * self.fsdp + coords.fsdp) * self.expert + coords.expert
        return slice(s * per, (s + 1) * per)

    def _param_of(self, name: str) -> str:
        """The parameter a key names: itself, or "<param>" of an optimizer "<param>/<slot>"."""
        return name if name in self._shapes else name.rsplit("/", 1)[0]

    def shard_params(self, params: Mapping[str, np.ndarray], coords: DeviceCoords
                     ) -> dict[str, np.ndarray]:
        """A device's chunks of whole-model arrays: its experts' slice (expert weights),
        the tensor slice, then fsdp chunk ``coords.fsdp``, per key.

        Args:
            params: the whole model's parameters (``model.init_params``, a
                checkpoint), or an optimizer state of them ("<key>/<slot>" keys,
                shaped like the parameter).
            coords: the device's coordinates.

        Returns:
            The same keys -> 1-D chunks in the storage dtype (float32, or bf16 under
            ``weight_dtype: bfloat16``, rounded to nearest even).
        """
        out = {}
        for key, value in params.items():
            a = np.asarray(value, np.float32)
            experts = self._expert_split[self._param_of(key)]
            if experts is not None:
                a = np.split(a, self.expert, axis=experts)[coords.expert]
            axis = self._split[self._param_of(key)]
            if axis is not None:
                a = np.split(a, self.tensor, axis=axis)[coords.tensor]
            out[key] = flat_chunk(a, self.fsdp, coords.fsdp).astype(self.storage, copy=False)
        return out

    def init_local(self, seed: int, coords: DeviceCoords) -> DeviceShard:
        """The device's shard of ``model.init_params(seed)`` and a fresh optimizer
        state for it, so that a sharded run starts where a single-device one does."""
        params = self.shard_params(self.model.init_params(seed), coords)
        return DeviceShard(coords, params, self.optimizer.init(params))

    def shape_shard(self, coords: DeviceCoords = DeviceCoords()) -> DeviceShard:
        """A timing-only device's parameter and optimizer-state chunks: read-only zero
        views of the sizes :meth:`init_local` gives (no memory)."""
        params = {k: timing_zeros((self._chunk_count([k]),), self.storage) for k in self._shapes}
        state = {f"{k}/{slot}": v for k, v in params.items() for slot in self.optimizer.slots}
        return DeviceShard(coords, params, state)

    def load_local(self, params: Mapping[str, np.ndarray], opt_state: Mapping[str, np.ndarray],
                   coords: DeviceCoords, model_state: Mapping[str, np.ndarray] | None = None
                   ) -> DeviceShard:
        """The device's shard of a whole model's parameters and optimizer state (a
        checkpoint's, :meth:`assemble`'s output): the inverse of :meth:`assemble`, so a
        run resumed from it continues bit for bit (padding is zeros, as a run keeps it).

        ``model_state`` is ignored (the transformer has none).

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
            shards: DeviceShards covering every (fsdp, tensor) pair (with every
                expert position when experts are split) with ``coords.data == 0``
                (others are ignored), e.g. every device's.
            opt_state: assemble ``DeviceShard.opt_state`` instead of ``params``.

        Returns:
            key -> float32 array shaped as ``model.param_shapes`` (of the key's
            parameter for an optimizer state key).

        Raises:
            ValueError: a (fsdp, tensor) pair (or an expert position) of data
                replica 0 is missing.
        """
        have = {(s.coords.fsdp, s.coords.tensor, s.coords.expert):
                (s.opt_state if opt_state else s.params) for s in shards if s.coords.data == 0}
        missing = [(f, t) if self.expert == 1 else (f, t, e) for f in range(self.fsdp)
                   for t in range(self.tensor) for e in range(self.expert)
                   if (f, t, e) not in have]
        if missing:
            which = "(fsdp, tensor)" if self.expert == 1 else "(fsdp, tensor, expert)"
            raise ValueError(f"assemble needs the shards of data replica 0, missing {which} "
                             f"{missing}")
        return {key: self._assemble_key(have, key).astype(np.float32, copy=False)
                for key in have[(0, 0, 0)]}

    def _assemble_key(self, have: Mapping[tuple[int, int, int], Mapping[str, np.ndarray]],
                      key: str) -> np.ndarray:
        """One whole array from every (fsdp, tensor, expert) chunk of it."""
        param = self._param_of(key)
        shape, axis, experts = self._shapes[param], self._split[param], self._expert_split[param]
        blocks = []
        for e in range(self.expert if experts is not None else 1):
            pieces = []
            for t in range(self.tensor if axis is not None else 1):
                flat = np.concatenate([have[(f, t, e)][key] for f in range(self.fsdp)])
                pieces.append(flat[:math.prod(shape)].reshape(shape))
            blocks.append(pieces[0] if axis is None else np.concatenate(pieces, axis=axis))
        return blocks[0] if experts is None else np.concatenate(blocks, axis=experts)

    # ------------------------------------------------------------ memory

    def param_layout(self) -> list[ParamLayout]:
        """Every parameter's sharding, in layer order: its tensor split and the size
        of one device's chunk (the console's sharding table, ``describe``)."""
        whole = self.model.param_shapes
        out = []
        for layer, keys in zip(self.local_model.layers, self._owned, strict=True):
            for key in keys:
                local = tuple(self._shapes[key])
                out.append(ParamLayout(layer=layer.name, key=key, shape=tuple(whole[key]),
                                       tensor_dim=self._split[key], local_shape=local,
                                       device_elements=-(-math.prod(local) // self.fsdp),
                                       expert_dim=self._expert_split[key]))
        return out

    def local_param_bytes(self) -> int:
        """Bytes of one device's parameter chunks in their storage dtype (float32, or
        bf16; the gradient chunks after the reduce-scatter are as large)."""
        return self._chunk_bytes(self._shapes)

    def optimizer_state_bytes(self) -> int:
        """Bytes of one device's optimizer state (slots x its chunks, stored as they are)."""
        return len(self.optimizer.slots) * self.local_param_bytes()

    def gathered_layer_bytes(self) -> int:
        """Bytes of the largest layer after its fsdp all-gather in the storage dtype
        (tensor-local, padding included): the workspace FSDP adds."""
        return max(self.fsdp * self._chunk_bytes(k for k, _ in keys) for keys in self._keys)

    def _chunk_bytes(self, keys: Iterable[str]) -> int:
        """Bytes of this device's chunks of ``keys`` in the storage dtype."""
        return self.storage.itemsize * sum(-(-math.prod(self._shapes[k]) // self.fsdp)
                                           for k in keys)

    def memory(self, per_device_batch: int, precision: str = "bf16", *,
               prefetch_layers: int = PREFETCH_LAYERS) -> DeviceMemory:
        """One device's HBM in a training step at its peak (``pod.programs.memory``: the
        largest of the forward, loss and backward phases), as XLA holds MaxText's step.

        With ``p`` the parameter elements the device keeps (its chunks, padding
        included; the vocabulary tables split over tensor as on the TPU), ``w`` the
        bytes of a stored weight (``weight_dtype``), ``a`` those of an activation
        (``precision``), ``b`` the per-device batch and T, C, V the sequence, width and
        vocabulary:

        - parameters ``w p``; optimizer state ``slots w p``; gradients ``w p`` from
          backward on (the accumulator of the sharded gradients);
        - activations: what the remat policy keeps (``TransformerModel.
          activation_memory``: the residual stream split over tensor, MaxText's
          ``activation_embed`` rule; offloaded tensors on the host);
        - workspace: the weights' copy in the compute dtype (``a p``, weights stored
          wider); with fsdp, the weight array gathered for the matmul running and the
          ``prefetch_layers`` gathered ahead (``gather_bytes`` x :meth:`largest_gathered`
          each); a block's backward working set (``b`` x
          ``pod.programs.memory.backward_working_bytes``); at the loss the logits, ``b T
          V / tensor`` in the compute dtype (/ ``num_vocab_tiling``), and with fsdp the
          output layer's weights gathered (C V / tensor); in backward the output layer's
          weight gradient (V C, whole) or, under host offload, the logits' gradient
          (``pod.programs.memory.output_gradient_held``); with an expert
          axis the all-to-all buffers (``ExpertCollectives.buffer_elements``).

        Args:
            per_device_batch: examples per device (global batch / (data x fsdp x expert)).
            precision: bf16 | fp32 | int8.
            prefetch_layers: weight arrays gathered ahead of the one in use (fsdp > 1).

        Raises:
            ValueError: an unknown precision, a negative batch or prefetch.
        """
        if int(per_device_batch) < 0 or int(prefetch_layers) < 0:
            raise ValueError(f"per_device_batch {per_device_batch} and prefetch_layers "
                             f"{prefetch_layers} must be >= 0")
        cfg, b = self.model.config, int(per_device_batch)
        act, w = compute_bytes(precision), self.model.storage_dtype.itemsize
        blocks = [i for i, layer in enumerate(self.local_model.layers)
                  if isinstance(layer, TransformerBlock)]
        block = self.local_model.layers[blocks[0]]
        assert isinstance(block, TransformerBlock)
        params = self._hardware_elements()
        acts = self.model.activation_memory(b, precision=precision, tensor=self.tensor)
        assert acts is not None  # the program's tensor size splits the heads and MLP
        kept = acts.device_bytes
        k = int(prefetch_layers) if self.fsdp > 1 else 0
        layer = gather_bytes(precision) * self.largest_gathered(blocks) if self.fsdp > 1 else 0
        common = (("weights in compute dtype", act * params if w > act else 0),
                  ("gathered weights", (1 + k) * layer),
                  ("layer working set", b * backward_working_bytes(
                      block, (cfg.sequence_length, cfg.embed_dim), act, self.tensor)),
                  ("all-to-all buffers", self._all_to_all_bytes(block, b, act)))
        logits, table = self._logits_bytes(b, act), self._output_table_bytes()
        loss = (common[0], ("gathered weights", k * layer), ("logits", logits),
                ("output layer gathered", gather_bytes(precision) * table if self.fsdp > 1 else 0))
        late = output_gradient_held(cfg.tied_embeddings, acts.host_bytes > 0, logits,
                                    act * cfg.vocabulary * cfg.embed_dim)
        phases = [Phase("forward", 0, kept, common), Phase("loss", 0, kept, loss),
                  Phase("backward", w * params, kept, (*common, late))]
        return peak_memory(w * params, len(self.optimizer.slots) * w * params, phases,
                           host_activations_bytes=acts.host_bytes, prefetch_layers=k,
                           prefetch_layer_bytes=layer)

    def largest_gathered(self, layers: Iterable[int]) -> int:
        """Elements of the largest weight array of ``layers`` (indices into the local
        model's layers) as its fsdp all-gather assembles it: tensor-local (an MoE's
        experts of the device), whole over fsdp, padding included. XLA gathers each
        weight array just before its matmul and the next one while it runs."""
        layers = tuple(layers)
        memo = self._counts.memo
        got = memo.get(("largest gathered", layers))
        if got is None:
            got = memo[("largest gathered", layers)] = max(
                self.fsdp * self._chunks[key] for i in layers for key, _ in self._keys[i])
        return got

    #: the vocabulary tables: replicated over tensor in this program, split over tensor on
    #: the vocabulary by XLA under MaxText's rules (``vocab`` -> tensor)
    _TABLES = ("embed/embedding", "unembed/kernel")

    def _hardware_elements(self) -> int:
        """The parameter elements one device keeps on the hardware: its chunks (padding
        included), the vocabulary tables split over tensor too, as MaxText shards them
        (this program keeps them whole on every tensor device; the plan is the TPU's)."""
        memo = self._counts.memo
        got = memo.get("hardware elements")
        if got is None:
            tables = [k for k in self._TABLES if k in self._shapes]
            rest = self._chunk_count(k for k in self._shapes if k not in tables)
            got = memo["hardware elements"] = rest + sum(
                -(-math.prod(self._shapes[k]) // (self.fsdp * self.tensor)) for k in tables)
        return got

    def _logits_bytes(self, b: int, act: int) -> int:
        """The logits of ``b`` examples over the device's vocabulary (V / tensor,
        MaxText's ``activation_vocab``) in the compute dtype, one chunk of the tokens
        at a time with ``num_vocab_tiling``: XLA fuses the float32 cast, the
        log-softmax and the loss's gradient into the reductions and the one fusion
        that writes the gradient in place of the logits."""
        cfg = self.model.config
        tiles = int(getattr(cfg, "num_vocab_tiling", 1) or 1)
        return -(-b * cfg.sequence_length * -(-cfg.vocabulary // self.tensor) * act // tiles)

    def _output_table_bytes(self) -> int:
        """Elements of the output layer's weights on one device, whole over fsdp: C x V
        / tensor (what its all-gather brings for the logits)."""
        cfg = self.model.config
        return cfg.embed_dim * -(-cfg.vocabulary // self.tensor)

    def _all_to_all_bytes(self, block: TransformerBlock, b: int, act: int) -> int:
        """An MoE block's dispatch buffers on an expert axis: the tokens sent and those
        received, ``b`` x its dispatch slots x C each (``ExpertCollectives``); 0 without."""
        if self.expert == 1 or not block.moe:
            return 0
        cfg = self.model.config
        return 2 * b * ExpertCollectives.buffer_elements(block.mlp, cfg.sequence_length,
                                                         cfg.embed_dim) * act

    # ------------------------------------------------------------ the step

    def train_step(self, core, comm: DeviceCollectives, shard: DeviceShard, x: np.ndarray,
                   y: np.ndarray, step: int, *, rng=None) -> StepResult:
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
            rng: unused (the model has no dropout).

        Returns:
            StepResult: this device's mean loss (with the MoE blocks'
            load-balancing losses), its new shard, where the optimizer's records
            start, the MoE blocks' routing of its tokens.

        Raises:
            ValueError: comm or shard do not belong to this mesh or device.
        """
        self._check(comm, shard)
        out, caches = self._forward(core, comm, shard, x, "fwd", training=True)
        loss, dy = self.local_model.output_loss(core, out, y[:, self.sequence_slice(shard.coords)])
        loss = loss + moe_aux_loss(caches)
        grads = self._backward(core, comm, shard, caches, dy)
        update_start = len(core.records)
        params, state = self._update(core, comm, grads, shard, step)
        return StepResult(loss, DeviceShard(shard.coords, params, state), update_start,
                          router_loads=router_loads(caches))

    def _update(self, core, comm, grads, shard: DeviceShard, step: int):
        """The optimizer's update of this device's chunks; on a timing-only core with a
        ``LayerTape`` (``pod.programs.replay``), the whole update replayed when the same
        ran before (another point of a layout search with these chunks), else each
        parameter's when the same one did (the blocks' parameters are alike)."""
        tape = getattr(comm, "tape", None)
        if tape is None or core.execute:
            return self.optimizer.update(core, grads, shard.opt_state, shard.params, step)

        def each(key: str, args: tuple, run):  # its records are named after the key
            return tape.run(core, comm, self._layer_names, self._key_layer[key],
                            self.optimizer, "update", (key, *args), run)

        return tape.run(core, comm, self._layer_names, 0, self.optimizer, "update all",
                        (grads, shard.opt_state, shard.params, step),
                        lambda: self.optimizer.update(core, grads, shard.opt_state,
                                                      shard.params, step, each=each))

    #: test examples an evaluation takes at most (cut to a multiple of data x fsdp): the
    #: sharded forward pass is costly to emulate and the loss settles on fewer
    EVAL_EXAMPLES = 256

    def eval_slice(self, num_examples: int, coords: DeviceCoords) -> slice:
        """This device's examples of an evaluation set: the first ``EVAL_EXAMPLES`` (at
        most), cut to a multiple of data x fsdp, split as a training batch (every
        device takes part in the forward pass's collectives)."""
        n = min(int(num_examples), self.EVAL_EXAMPLES) // self.batch_shards * self.batch_shards
        if n == 0:
            return slice(0, 0)
        return self.batch_slice(n, coords)

    def counts_eval(self, coords: DeviceCoords) -> bool:
        """The tensor devices of a group predict the same tokens (without sequence
        parallelism): only the first counts."""
        return self.sequence_parallel or coords.tensor == 0

    def evaluate(self, core, comm: DeviceCollectives, shard: DeviceShard, x: np.ndarray,
                 y: np.ndarray) -> EvalSums:
        """Eval-mode sums over this device's (x, y) (its tokens, or its sequence chunk
        with sequence parallelism): the losses, the next tokens predicted right, the
        tokens; with the collectives of a forward pass (tagged "eval")."""
        self._check(comm, shard)
        if x.shape[0] == 0:
            return EvalSums(0.0, 0, 0)
        out, _ = self._forward(core, comm, shard, x, "eval", training=False)
        labels = y[:, self.sequence_slice(shard.coords)]
        loss, _ = self.local_model.output_loss(core, out, labels)
        correct = int((np.asarray(out).argmax(axis=-1) == labels).sum()) if core.execute else 0
        return EvalSums(float(loss) * labels.size, correct, int(labels.size))

    def _check(self, comm: DeviceCollectives, shard: DeviceShard) -> None:
        got = {a: comm.axis_size(a) for a in AXES}
        if got != self.sizes:
            raise ValueError(f"the collectives' mesh {got} is not the program's {self.sizes}")
        if DeviceCoords.of(comm) != shard.coords:
            raise ValueError(f"shard of {shard.coords} given to the device at "
                             f"{DeviceCoords.of(comm)}")

    def _hooks(self, core, comm: DeviceCollectives, phase: str) -> dict:
        """The blocks' keywords: their tensor operators and their MoE's expert
        collectives (each None on one device: one device's code path)."""
        return {"tensor": (TensorCollectives(core, comm, phase, self.sequence_parallel)
                           if self.tensor > 1 else None),
                "experts": (ExpertCollectives(core, comm, phase)
                            if self.expert > 1 and self.model.config.experts else None)}

    def _gather(self, core, comm: DeviceCollectives, shard: DeviceShard, i: int,
                phase: str) -> dict[str, np.ndarray]:
        """Layer i's tensor-local params, all-gathered over fsdp, MXU weights rounded
        to bf16 when ``core.numerics`` (as ``TransformerModel.prepare_params``); on a
        timing-only core the call is issued and the layer gets zero views."""
        keys = self._keys[i]
        if not keys:
            return {}
        layer = self.local_model.layers[i]
        tag, after = f"{layer.name} {phase}", len(core.records)
        itemsize = self._gather_itemsize(core)
        if not core.execute:
            count = self._layer_chunks.get(i)
            if count is None:
                count = self._layer_chunks[i] = self._chunk_count(k for k, _ in keys)
            comm.all_gather("fsdp", timing_zeros((count,), np.float32),
                            tag=tag, kind="param_gather", after_record=after, itemsize=itemsize)
            zeros = self._zero_params.get(i)  # one read-only dict of zero views per layer
            if zeros is None:
                zeros = self._zero_params[i] = {local: timing_zeros(self._shapes[key], np.float32)
                                                for key, local in keys}
            return zeros
        mine = np.concatenate([shard.params[k] for k, _ in keys]).astype(np.float32, copy=False)
        full = comm.all_gather("fsdp", mine, tag=tag, kind="param_gather", after_record=after,
                               itemsize=itemsize)
        arrays = unpack_gathered(full, [self._shapes[k] for k, _ in keys], self.fsdp)
        return {local: (to_bf16(a) if core.numerics and local in layer.matmul_params else a)
                for (_, local), a in zip(keys, arrays, strict=True)}

    def _forward(self, core, comm, shard, x, phase, *, training):
        """Forward through the layers; with sequence parallelism the layers after
        the embedding see this device's sequence chunk only."""
        caches = []
        hooks = self._hooks(core, comm, phase)
        for i in range(len(self.local_model.layers)):
            x, cache = self._layer_forward(core, comm, shard, i, x, phase, hooks,
                                           training=training)
            caches.append(cache)
        return x, caches

    def _layer_forward(self, core, comm, shard, i, x, phase, hooks, *, training, params=None):
        """Layer i's forward: its parameters gathered (or ``params``, gathered before),
        its tensor operators; after the embedding, with sequence parallelism, this
        device's sequence chunk. Returns (output, cache)."""
        layer = self.local_model.layers[i]
        p = self._gather(core, comm, shard, i, phase) if params is None else params
        hook = hooks if isinstance(layer, TransformerBlock) else {}
        x, cache = self._pass(core, comm, i, "forward", (p, x, training, hook),
                              lambda: layer.forward(core, p, x, training=training, **hook))
        if i == 0 and self.sequence_parallel:
            x = x[:, self.sequence_slice(shard.coords)]                    # (B, T / tensor, C)
        return x, cache

    def _check_buckets(self, buckets: Sequence[tuple[Sequence[str], int]] | None
                       ) -> tuple[tuple[tuple[str, ...], list[str]], ...]:
        """((layer names), [the parameter keys they own]) per bucket, in backward order
        (as ``ReplicatedProgram.buckets``); every layer owning parameters in exactly one
        (None: each its own bucket)."""
        keys = {layer.name: owned for layer, owned in zip(self.local_model.layers, self._owned,
                                                          strict=True) if owned}
        owning = list(keys)[::-1]                                       # backward order
        names = ([(name,) for name in owning] if buckets is None
                 else [tuple(layers) for layers, _ in buckets if layers])
        if sorted(n for layers in names for n in layers) != sorted(owning):
            raise ValueError(f"gradient buckets hold the layers {[n for b in names for n in b]}; "
                             f"every layer with parameters exactly once: {owning}")
        return tuple((layers, [k for n in layers for k in keys[n]]) for layers in names)

    def _backward(self, core, comm, shard, caches, dy) -> dict[str, np.ndarray]:
        """Backward through the layers, last first; a bucket's gradients (the layers'
        own, ``buckets``) leave as chunks (:meth:`_reduce`) as soon as the backward
        of its last layer is done."""
        layers = self.local_model.layers
        hooks = self._hooks(core, comm, "bwd")
        grads: dict[str, np.ndarray] = {}
        chunks: dict[str, np.ndarray] = {}
        bucket: dict[str, np.ndarray] = {}
        for i in range(len(layers) - 1, -1, -1):
            dy = self._layer_backward(core, comm, shard, i, caches[i], dy, hooks, grads, "tied")
            bucket.update({k: grads.pop(k) for k in self._owned[i]})
            first = self._bucket_ends.get(layers[i].name)
            if first is not None:
                chunks.update(self._reduce(core, comm, first, bucket))
                bucket = {}
        return chunks

    def _layer_backward(self, core, comm, shard, i, cache, dy, hooks, grads, sum_name,
                        params=None):
        """Layer i's backward: its parameters gathered if it reads them (or ``params``,
        gathered before), its tensor operators; its gradients added into ``grads`` (by
        model key; a key already there is summed by a VPU op
        "<layer>/<sum_name>_grad_sum": a tied parameter, or the microbatches of a
        pipeline). Returns the input gradient (None for the embedding)."""
        layer = self.local_model.layers[i]
        if not layer.backward_reads_params:
            p = {}
        else:
            p = self._gather(core, comm, shard, i, "bwd") if params is None else params
        hook = hooks if isinstance(layer, TransformerBlock) else {}
        if i == 0 and self.sequence_parallel:  # the embedding saw the whole sequence
            shape = (dy.shape[0], self.model.config.sequence_length, dy.shape[2])
            if core.execute:
                full = np.zeros(shape, dy.dtype)
                full[:, self.sequence_slice(shard.coords)] = dy
                dy = full
            else:
                dy = timing_zeros(shape, dy.dtype)
        dy, g = self._pass(core, comm, i, "backward", (p, cache, dy, i > 0, hook),
                           lambda: layer.backward(core, p, cache, dy, need_dx=i > 0, **hook))
        for key, local in self._keys[i]:
            grads[key] = g[local] if key not in grads else vector_op(
                core, f"{layer.name}/{sum_name}_grad_sum", np.add, grads[key], g[local],
                out=(g[local].shape, np.float32))
        return dy

    def _pass(self, core, comm, i: int, method: str, args: tuple, run):
        """``run()``, layer i's ``method`` pass on ``args``; on a timing-only core whose
        collectives carry a ``LayerTape`` (``ShapeCollectives(tape=...)``), replayed from
        the tape when the same pass ran before (``pod.programs.replay``)."""
        tape = getattr(comm, "tape", None)
        if tape is None or core.execute:
            return run()
        return tape.run(core, comm, self._layer_names, i, self.local_model.layers[i], method,
                        args, run)

    @property
    def gradient_divisor(self) -> int:
        """The gradients' sum over the devices is divided by this: the token shards
        (:attr:`token_shards`; a pipeline multiplies it by its microbatches)."""
        return self.token_shards

    def _gather_itemsize(self, core) -> int:
        """Bytes per weight an fsdp all-gather moves: the MXU's operand dtype
        (``wire_itemsize``: bf16 under bf16 precision), at most the stored one (a
        bf16-stored parameter gathers in bf16 whatever the precision)."""
        return min(wire_itemsize(core), self.storage.itemsize)

    def _reduce(self, core, comm, name: str, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A layer's gradients -> this device's chunks of the global-batch mean:
        reduce-scatter over fsdp, allreduce over data (and over expert, but for the
        experts' own weights), times 1 / (data x fsdp x expert). Under ``weight_dtype:
        bfloat16`` the gradients are bf16 (the dtype of the parameters): each device's
        rounded to bf16, moved as bf16 on the wire and stored as bf16 (the sums run
        in float32 here, rounded once at the end)."""
        if not grads:
            return {}
        widths = [chunk_elements(g.size, self.fsdp) for g in grads.values()]
        bf16 = self.storage != np.float32
        wire = {"itemsize": self.storage.itemsize} if bf16 else {}
        kw = {"tag": f"{name} grads", "kind": "grad_reduce", **wire}
        if core.execute:
            buf = pack_chunks(list(grads.values()), self.fsdp)
            if bf16:
                buf = to_bf16(buf)
        else:  # timing-only: a buffer of the size pack_chunks would build, no copy
            buf = timing_zeros((self.fsdp * sum(widths),), np.float32)
        part = comm.reduce_scatter("fsdp", buf, **kw, after_record=len(core.records))
        part = comm.allreduce("data", part, **kw, after_record=len(core.records))
        if self.expert > 1:  # replicated over expert: each device saw its own tokens
            part = self._allreduce_keys(core, comm, "expert", f"{name} grads", grads, widths,
                                        part, lambda k: self._expert_split[k] is None, wire)
        if self.sequence_parallel and self.tensor > 1:  # replicated params saw a chunk each
            part = self._allreduce_keys(core, comm, "tensor", f"{name} replicated grads", grads,
                                        widths, part, lambda k: self._split[k] is None, wire)
        elif self.tensor > 1:  # a scale shared by the heads: each device saw its own heads
            part = self._allreduce_keys(core, comm, "tensor", f"{name} head-shared grads",
                                        grads, widths, part, self._partial.__contains__, wire)
        part = stored(core, part, self.storage)
        if self.gradient_divisor > 1:
            scale = np.float32(1.0 / self.gradient_divisor)
            part = vector_op(core, f"{name}/grad_mean",
                             lambda g, sc: (np.asarray(g, np.float32) * sc).astype(self.storage),
                             part, scale, out=(part.shape, self.storage))
        if not core.execute:
            return {key: timing_zeros((n,), self.storage)
                    for key, n in zip(grads, widths, strict=True)}
        return dict(zip(grads, np.split(part, np.cumsum(widths)[:-1]), strict=True))

    def _allreduce_keys(self, core, comm, axis: str, tag: str, grads, widths, part,
                        replicated, wire=None) -> np.ndarray:
        """Allreduce over ``axis`` the chunks of the keys ``replicated(key)`` selects:
        parameters replicated over an axis whose devices saw different tokens (with
        sequence parallelism the norms and embeddings over tensor, which saw a
        sequence chunk each; with experts everything but the experts over expert)."""
        chosen = [(w, e) for k, w, e in zip(grads, widths, np.cumsum(widths), strict=True)
                  if replicated(k)]
        if not chosen:
            return part
        kw = {"tag": tag, "kind": "grad_reduce", "after_record": len(core.records), **(wire or {})}
        count = sum(w for w, _ in chosen)
        if not core.execute:  # the sizes only: no index arrays (an embedding's are MBs)
            comm.allreduce(axis, timing_zeros((count,), np.float32), **kw)
            return part
        if count == part.size:
            return comm.allreduce(axis, part, **kw)
        index = np.concatenate([np.arange(e - w, e) for w, e in chosen])
        part = np.array(part)                                             # may be read-only
        part[index] = comm.allreduce(axis, part[index], **kw)
        return part

    def _chunk_count(self, keys: Iterable[str]) -> int:
        """Elements of this device's chunks of ``keys`` (padded, ``flat_chunk``)."""
        return sum(map(self._chunks.__getitem__, keys))
