"""The transformer pipelined over a ``stage`` axis: layers split into stages, the batch
into microbatches, activations and their gradients passed stage to stage by ppermute.

Layout ([MaxText] ``layers/pipeline.py``, ``ici_pipeline_parallelism``,
``num_pipeline_microbatches``, ``num_pipeline_repeats``; [GPipe] Huang et al.
2019; [1F1B] Narayanan et al. 2021 (Megatron-LM) and 2019 (PipeDream); [SB]
"How to Scale Your Model", training chapter):

- **stages**: the transformer's L blocks are cut into V = S R equal chunks
  (S stages, R repeats), chunk ``v`` on stage ``v mod S`` (MaxText's circular
  layout: with R > 1 a stage holds R chunks, ``L / V`` blocks each). The token
  embedding joins virtual stage 0 (stage 0), the final norm, the unembedding
  and the loss join the last (stage S - 1). A device keeps its stage's
  parameters only (and their optimizer state), sharded inside the stage over
  fsdp and tensor as :class:`pod.programs.transformer.ShardedTransformer`
  shards the whole model; its fsdp gathers, tensor collectives and data
  gradient reduction run unchanged inside the stage. Its fsdp all-gathers run
  once per layer, microbatch and phase (forward, and backward where the
  layer reads its weights); with ``fsdp_ag_once`` (MaxText's
  ``pipeline_fsdp_ag_once``) once per layer per step (per repeat with R > 1:
  each chunk's layers at its first microbatch), the gathered weights kept
  until the layer's last backward.
- **microbatches**: a device's examples (the global batch over data x fsdp)
  are cut into M microbatches; the schedule (``gpipe``, ``1f1b``,
  ``circular``: :mod:`pod.programs.pipeline_schedule`) says which stage runs
  which microbatch's forward or backward at each tick. After each tick the
  outputs move one stage on (forward) and the input gradients one stage back
  (backward) by a collective permute over ``stage`` (cyclic, as MaxText's),
  in the activations' dtype; a stage waits for a piece only where it uses it
  (``pod.programs.collectives.defer_wait``), so the clock
  (``pod.report.clock``) sees the dataflow of the schedule and the bubble as
  the waits for the other stages.
- **gradients**: accumulated over the microbatches in the stage's
  tensor-local arrays, then reduced once per step as the non-pipelined
  program reduces them (reduce-scatter over fsdp, allreduce over data,
  scaled by 1 / (data x fsdp x M)), in buckets as the non-pipelined program
  reduces them (``training.overlap_bucket_bytes``: a stage combines its layers'
  gradients in the order their last microbatch's backward is done, and reduces
  a bucket as soon as its last layer's is; as MaxText's ``pipeline_fsdp_ag_once`` does
  for the gradients; DeepSpeed likewise keeps ZeRO's gradient partitioning
  out of pipelines). Stages share no layer, so they exchange no gradient,
  except a **tied embedding**: its table lives on the first and the last
  stage (lookup and logits); each reduces its own part, then one allreduce
  over ``stage`` sums them (the other stages add zeros), so both keep the same
  table and the run equals one device's. Untying is not needed.
- **loss**: computed by the last stage; each microbatch's loss rides with its
  gradient back through the stages (one more element of the backward
  buffer), so every device reports the step's loss without a collective.
- the optimizer runs once per step on the device's own parameters.

The SPMD program every device runs is the tick loop :func:`run_ticks`, written
once over a :class:`StageWork` (what a stage computes for an op): the
transformer's is :class:`_TransformerStage`; a test can pass its own. On a
timing-only core the same ops and calls are recorded with zero views.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np

from pod.memory import DeviceMemory
from pod.programs.collectives import AXES, DeviceCollectives, defer_wait
from pod.programs.contract import DeviceCoords, DeviceShard, EvalSums, StepResult
from pod.programs.memory import (
    PREFETCH_LAYERS,
    backward_working_bytes,
    compute_bytes,
    gather_bytes,
)
from pod.programs.pipeline_schedule import PipelineSchedule, PipeOp, build_schedule
from pod.programs.replicated import combine_buckets
from pod.programs.tensor import wire_itemsize
from pod.programs.transformer import ShardedTransformer
from pod.workloads.block import TransformerBlock
from pod.workloads.layers import timing_zeros
from pod.workloads.optimizers import Optimizer
from pod.workloads.transformer import TransformerModel

__all__ = ["StageWork", "run_ticks", "PipelinedTransformer", "stage_layers"]

_F32 = np.float32
_ORIGIN = DeviceCoords()  # the first device of the mesh


class StageWork(Protocol):
    """What one stage computes for the ops of a schedule (:func:`run_ticks`)."""

    def buffer_elements(self, phase: str) -> int:
        """Elements of the flat float32 buffer the stage sends in ``phase`` ("fwd":
        a microbatch's activations; "bwd": their gradient and what rides with it)."""

    def forward(self, op: PipeOp, x: np.ndarray | None) -> np.ndarray | None:
        """``op``'s forward; ``x`` the previous virtual stage's buffer (None on virtual
        stage 0). Returns the buffer to send on (None on the last virtual stage)."""

    def backward(self, op: PipeOp, dy: np.ndarray | None) -> np.ndarray | None:
        """``op``'s backward; ``dy`` the next virtual stage's buffer (None on the last).
        Returns the buffer to send back (None on virtual stage 0)."""


def run_ticks(schedule: PipelineSchedule, stage: int, comm: DeviceCollectives, core: Any,
              work: StageWork, *, tag: str, itemsize: int, first_point: int = 1) -> int:
    """The SPMD tick loop of one stage (module docstring): at each tick the stage runs
    its op, if any, then takes part in the tick's permutes (forward: +1, backward:
    -1, each only when some stage sends that way), sending its output or zeros.

    What it receives for a later op waits in an inbox; the wait for it is moved to
    where that op starts (``defer_wait``); a piece it does not use is waited for
    nowhere.

    Args:
        schedule: the ticks.
        stage: this device's stage (its ``stage`` axis index).
        comm: its collectives; core: its TensorCore (``len(core.records)`` places
            every call).
        work: the stage's computation.
        tag: the permutes' tag prefix ("pipeline" in training, "eval").
        itemsize: bytes per element on the wire (the activations' dtype).
        first_point: the ``align`` point of tick 0 (each tick is one).

    Returns:
        The next free ``align`` point.
    """
    last = schedule.virtual_stages - 1
    inbox: dict[PipeOp, tuple[np.ndarray, int | None]] = {}
    recorded = comm.axis_size("stage") > 1
    for t, row in enumerate(schedule.ticks):
        op = row[stage]
        out: dict[str, np.ndarray | None] = {"fwd": None, "bwd": None}
        if op is not None:
            v = schedule.virtual(stage, op)
            data = None
            if (op.phase == "fwd" and v > 0) or (op.phase == "bwd" and v < last):
                data, index = inbox.pop(op)
                defer_wait(comm.calls, index, len(core.records))
            out[op.phase] = work.forward(op, data) if op.phase == "fwd" else work.backward(op, data)
        comm.align(first_point + t)
        for phase, shift in (("fwd", 1), ("bwd", -1)):
            if not schedule.sends(t, phase):
                continue
            target = schedule.received(stage, t, phase)
            n = work.buffer_elements(phase)
            buf = out[phase]
            if buf is None:
                buf = timing_zeros((n,), _F32) if not core.execute else np.zeros(n, _F32)
            got = comm.ppermute("stage", buf, shift, tag=f"{tag} {phase} tick {t}",
                                kind="activation", after_record=len(core.records),
                                used=target is not None, itemsize=itemsize)
            if target is not None:
                inbox[target] = (got, len(comm.calls) - 1 if recorded else None)
    return first_point + len(schedule.ticks)


def stage_layers(layers: int, stages: int, repeats: int) -> list[list[int]]:
    """Per virtual stage v = 0 .. S R - 1, its layer indices in a transformer of
    ``layers`` blocks (``TransformerModel.layers``: embed, block1 .. blockL,
    final_norm, unembed): ``L / (S R)`` consecutive blocks, the embedding on the
    first, the final norm and the unembedding on the last.

    Raises:
        ValueError: L not a multiple of S R (one line, with the sizes that divide).
    """
    chunks = stages * repeats
    if layers % chunks:
        fit = ", ".join(str(d) for d in range(1, layers + 1) if layers % d == 0)
        raise ValueError(f"{layers} transformer layers do not split into {stages} stages x "
                         f"{repeats} repeats = {chunks} equal chunks; stages x repeats must "
                         f"divide the layers: {fit}")
    per = layers // chunks
    out = [list(range(1 + v * per, 1 + (v + 1) * per)) for v in range(chunks)]
    out[0].insert(0, 0)
    out[-1] += [layers + 1, layers + 2]
    return out


class PipelinedTransformer(ShardedTransformer):
    """The device program of the transformer on a mesh with a ``stage`` axis
    (module docstring); the same contract as :class:`ShardedTransformer`, whose
    per-layer machinery (gathers, tensor operators, gradient reduction) it runs
    on its stage's layers.

    Args:
        model: the whole TransformerModel.
        sizes: axis name -> size, ``stage`` among them.
        optimizer: the optimizer.
        microbatches: M, microbatches per step.
        schedule: gpipe, 1f1b or circular.
        repeats: R, chunks per stage (circular).
        sequence_parallel: Megatron sequence parallelism inside each stage.
        fsdp_ag_once: MaxText's ``pipeline_fsdp_ag_once``: a stage all-gathers each
            of its layers over fsdp once per step (at its first microbatch's
            forward) and keeps the gathered weights until its last microbatch's
            backward of that layer, instead of once per microbatch and phase.
        bucket_elements: a stage reduces its gradients in buckets of at most this many
            elements (``combine_buckets`` over its layers in the order its last
            microbatch's backward finishes them, as the sharded program over all
            layers: ``training.overlap_bucket_bytes`` means the same for both); None:
            one bucket after the stage's backward (no overlap).

    Attributes:
        stages, microbatches, repeats: S, M, R.
        fsdp_ag_once: as the argument.
        schedule, eval_schedule: the step's ticks and the evaluation's (forwards).
        chunks: per virtual stage, its layer indices (:func:`stage_layers`).

    Raises:
        ValueError: as ``ShardedTransformer``; a bad schedule
            (``pipeline_schedule.check_pipeline``); layers not divisible by S R; a
            mixture of experts (not modelled in a pipeline).
    """

    def __init__(self, model: TransformerModel, sizes: Mapping[str, int], optimizer: Optimizer,
                 *, microbatches: int, schedule: str = "gpipe", repeats: int = 1,
                 sequence_parallel: bool = False, fsdp_ag_once: bool = False,
                 bucket_elements: int | None = None):
        if model.config.experts:
            raise ValueError("a pipeline (stage axis) of a mixture of experts is not modelled: "
                             "its stages would carry the routers' balancing loss; use stage 1 "
                             "or a dense model (experts 0)")
        inner = {a: int(v) for a, v in sizes.items() if a != "stage"}
        super().__init__(model, inner, optimizer, sequence_parallel=sequence_parallel)
        self.stages = int(sizes.get("stage", 1))
        self.sizes = {a: (self.stages if a == "stage" else self.sizes[a]) for a in AXES}
        self.microbatches, self.repeats = int(microbatches), int(repeats)
        self.fsdp_ag_once = bool(fsdp_ag_once)
        self.schedule = build_schedule(schedule, self.stages, self.microbatches, self.repeats)
        self.eval_schedule = build_schedule(schedule, self.stages, self.microbatches,
                                            self.repeats, forward_only=True)
        key = ("pipeline layout", self.stages, self.microbatches, self.repeats, schedule,
               bucket_elements)
        kept = self._counts.memo.get(key)  # shared by the programs of the local model
        if kept is None:
            kept = self._counts.memo[key] = self._lay_out_stages(bucket_elements)
        self.chunks: list[list[int]] = kept[0]
        self._layers: list[list[int]] = kept[1]
        self._stage_keys: list[list[str]] = kept[2]
        # keys whose last backward use on the stage (its lowest layer) is layer i
        self._reduce_at: list[dict[int, list[str]]] = kept[3]
        #: per stage, the layers that close a gradient bucket (their last microbatch's
        #: backward done, the bucket's keys reduced as one)
        self._bucket_closers: list[frozenset[int]] = kept[4]
        #: parameters held by several stages (a tied embedding): their gradients are summed
        #: over stage
        self.shared_keys: list[str] = kept[5]

    def _lay_out_stages(self, bucket_elements: int | None) -> tuple[Any, ...]:
        """The chunks, each stage's layers, keys, reductions and bucket ends, and the keys
        several stages hold (``__init__``'s attributes; read only: programs of one local
        model and schedule share them)."""
        chunks = stage_layers(self.model.config.layers, self.stages, self.repeats)
        layers = [sorted(i for v in range(s, len(chunks), self.stages) for i in chunks[v])
                  for s in range(self.stages)]
        stage_keys = [list(dict.fromkeys(k for i in mine for k, _ in self._keys[i]))
                      for mine in layers]
        reduce_at: list[dict[int, list[str]]] = []
        for mine in layers:
            first = {k: i for i in reversed(mine) for k, _ in self._keys[i]}
            at: dict[int, list[str]] = {i: [] for i in mine}
            for k, j in first.items():  # in first's order, as a scan of it per layer
                at[j].append(k)
            reduce_at.append(at)
        closers = [self._stage_buckets(s, bucket_elements, chunks, reduce_at)
                   for s in range(self.stages)]
        holders: dict[str, int] = {}
        for keys in stage_keys:
            for k in keys:
                holders[k] = holders.get(k, 0) + 1
        shared = sorted(k for k, n in holders.items() if n > 1)
        return chunks, layers, stage_keys, reduce_at, closers, shared

    def _stage_buckets(self, stage: int, bucket_elements: int | None,
                       chunks: list[list[int]], reduce_at: list[dict[int, list[str]]]
                       ) -> frozenset[int]:
        """The layers of ``stage`` after whose last backward a bucket is reduced: the
        stage's layers owning gradients, in the order its schedule finishes them, combined
        by :func:`combine_buckets` (one bucket, after the stage's backward, when
        ``bucket_elements`` is None)."""
        done, order = [0] * self.repeats, list[int]()
        for op in self.schedule.ops(stage):
            if op.phase == "bwd":
                done[op.repeat] += 1
                if done[op.repeat] == self.microbatches:
                    order += reversed(chunks[self.schedule.virtual(stage, op)])
        owning = [i for i in order if reduce_at[stage][i]]
        elements = {i: sum(math.prod(self._shapes[k]) for k in reduce_at[stage][i])
                    for i in owning}
        cap = sum(elements.values()) if bucket_elements is None else int(bucket_elements)
        buckets = combine_buckets([(str(i), elements[i]) for i in owning], cap)
        return frozenset(int(layers[-1]) for layers, _ in buckets)

    @property
    def gradient_divisor(self) -> int:
        """Token shards x microbatches: the gradient is the mean over them."""
        return self.token_shards * self.microbatches

    # ------------------------------------------------------------ layout

    def stage_keys(self, stage: int) -> list[str]:
        """The model keys of the parameters ``stage`` holds."""
        return list(self._stage_keys[stage])

    def shard_params(self, params: Mapping[str, np.ndarray], coords: DeviceCoords
                     ) -> dict[str, np.ndarray]:
        """A device's chunks of whole-model arrays: its stage's keys only, each cut as
        ``ShardedTransformer.shard_params`` cuts it (optimizer-state keys follow their
        parameter)."""
        keep = set(self._stage_keys[coords.stage])
        return super().shard_params({k: v for k, v in params.items()
                                     if self._param_of(k) in keep}, coords)

    def init_local(self, seed: int, coords: DeviceCoords) -> DeviceShard:
        """The device's shard of ``model.init_params(seed)``: its stage's parameters."""
        params = self.shard_params(self.model.init_params(seed), coords)
        return DeviceShard(coords, params, self.optimizer.init(params))

    def shape_shard(self, coords: DeviceCoords = _ORIGIN) -> DeviceShard:
        """A timing-only device's chunks of its stage's parameters (zero views)."""
        keep = set(self._stage_keys[coords.stage])
        params = {k: timing_zeros((self._chunk_count([k]),), self.storage)
                  for k in self._shapes if k in keep}                     # the model's order
        slots: tuple[str, ...] = tuple(self.optimizer.slots)
        state = {f"{k}/{slot}": v for k, v in params.items() for slot in slots}
        return DeviceShard(coords, params, state)

    def assemble(self, shards: Iterable[DeviceShard], *, opt_state: bool = False
                 ) -> dict[str, np.ndarray]:
        """The whole model from the shards of data replica 0, stage by stage (a table
        two stages share is taken from the first; they hold the same bits).

        Raises:
            ValueError: a stage, or a (fsdp, tensor) pair of one, is missing.
        """
        shards = [s for s in shards if s.coords.data == 0]
        out: dict[str, np.ndarray] = {}
        for stage in range(self.stages):
            mine = [s for s in shards if s.coords.stage == stage]
            if not mine:
                raise ValueError(f"assemble needs the shards of every stage; stage {stage} of "
                                 f"data replica 0 is missing")
            for key, value in super().assemble(mine, opt_state=opt_state).items():
                out.setdefault(key, value)
        return out

    def stage_param_elements(self, stage: int) -> int:
        """Parameters one device of ``stage`` keeps (its chunks, padding included)."""
        return self._chunk_count(self._stage_keys[stage])

    def local_param_bytes(self) -> int:
        """Bytes of the parameter chunks of a device of the largest stage (as stored)."""
        return self.storage.itemsize * max(self.stage_param_elements(s) for s in range(self.stages))

    def largest_stage_layer(self, stage: int) -> int:
        """Parameters of ``stage``'s largest layer on one tensor device, whole over fsdp
        (what one all-gather brings)."""
        return max(sum(math.prod(self._shapes[k]) for k, _ in self._keys[i])
                   for i in self._layers[stage])

    def stage_gradient_bytes(self, stage: int) -> int:
        """float32 bytes of ``stage``'s gradient accumulator: its tensor-local arrays,
        whole over fsdp (reduce-scattered once per step)."""
        return 4 * sum(math.prod(self._shapes[k]) for k in self._stage_keys[stage])

    def memory(self, per_device_batch: int, precision: str = "bf16", *,
               prefetch_layers: int = PREFETCH_LAYERS) -> DeviceMemory:
        """One device's HBM in a training step: the largest of the stages'. A stage runs
        forwards and backwards of different microbatches interleaved, so what it holds
        is summed over the step, as ``ShardedTransformer.memory`` counts each item, with
        ``b`` the examples of a microbatch (``per_device_batch`` / M):

        - parameters and optimizer state of its stage's chunks (split over fsdp and
          tensor inside the stage; a tied table on the first and the last stage);
        - gradients: its accumulator, the stage's tensor-local arrays whole over fsdp in
          the weights' dtype (summed over the microbatches, reduced once per step);
        - activations: the (microbatch, chunk) forwards in flight on the stage
          (``PipelineSchedule.in_flight``: GPipe M R, 1F1B ``min(S - s, M)``) [GPipe]
          [1F1B] x ``b`` x a chunk's kept bytes per example (its blocks', and the output
          layer's inputs on the last stage);
        - workspace: the sharded weights' copy in the compute dtype (weights stored
          wider); with fsdp the gathered weight array in use and ``prefetch_layers``
          ahead (``gather_bytes`` x the stage's largest block array each), or with
          ``fsdp_ag_once`` the stage's whole weights gathered for the step; one layer's
          working set for a microbatch or, on the last stage, the loss's (the larger);
          the two permute buffers (a microbatch's activations forward and their
          gradient back).

        Raises:
            ValueError: an unknown precision or weight_dtype, a negative batch.
        """
        if int(per_device_batch) < 0 or int(prefetch_layers) < 0:
            raise ValueError(f"per_device_batch {per_device_batch} and prefetch_layers "
                             f"{prefetch_layers} must be >= 0")
        stages = [self._stage_memory(s, int(per_device_batch) // self.microbatches, precision,
                                     int(prefetch_layers)) for s in range(self.stages)]
        return max(stages, key=lambda m: m.total_bytes)

    def _stage_memory(self, stage: int, b: int, precision: str, prefetch: int) -> DeviceMemory:
        """One device of ``stage``: ``memory``'s items."""
        cfg = self.model.config
        act, w = compute_bytes(precision), self.model.storage_dtype.itemsize
        shape = (cfg.sequence_length, cfg.embed_dim)
        layers = self.local_model.layers
        blocks = [i for i in self._layers[stage] if isinstance(layers[i], TransformerBlock)]
        block = layers[blocks[0]]
        assert isinstance(block, TransformerBlock)
        last = stage == self.stages - 1
        per_chunk = len(blocks) // self.repeats
        kept_block, host_block = block.activation_bytes(shape, act, self.tensor)
        kept = per_chunk * kept_block + (self.model.output_kept_bytes(act, self.tensor)
                                         if last else 0)
        in_flight = self.schedule.in_flight(stage) * b
        params = self.stage_param_elements(stage)
        whole = self.stage_gradient_bytes(stage) // 4                    # tensor-local elements
        k = prefetch if self.fsdp > 1 else 0
        layer = gather_bytes(precision) * self.largest_gathered(blocks) if self.fsdp > 1 else 0
        gathered = (gather_bytes(precision) * whole if self.fsdp_ag_once and self.fsdp > 1
                    else (1 + k) * layer)
        working = b * backward_working_bytes(block, shape, act, self.tensor)
        loss = (self._logits_bytes(b, act) + (gather_bytes(precision) * self._output_table_bytes()
                                              if self.fsdp > 1 else 0)) if last else 0
        workspace = (("weights in compute dtype", act * params if w > act else 0),
                     ("gathered weights", gathered),
                     ("layer working set" if working >= loss else "loss working set",
                      max(working, loss)),
                     ("permute buffers", 2 * b * cfg.sequence_length * cfg.embed_dim * act))
        return DeviceMemory(w * params, w * whole, len(self.optimizer.slots) * w * params,
                            in_flight * kept, in_flight * per_chunk * host_block, workspace,
                            prefetch_layers=0 if self.fsdp_ag_once else k,
                            prefetch_layer_bytes=0 if self.fsdp_ag_once else layer,
                            peak=f"stage {stage}")

    def counts_eval(self, coords: DeviceCoords) -> bool:
        """Only the last stage predicts (and, without sequence parallelism, only its
        first tensor device counts)."""
        return coords.stage == self.stages - 1 and super().counts_eval(coords)

    def eval_slice(self, num_examples: int, coords: DeviceCoords) -> slice:
        """As ``ShardedTransformer.eval_slice``, cut to a multiple of data x fsdp x M."""
        unit = self.batch_shards * self.microbatches
        n = min(int(num_examples), self.EVAL_EXAMPLES) // unit * unit
        return self.batch_slice(n, coords) if n else slice(0, 0)

    # ------------------------------------------------------------ the step

    def train_step(self, core, comm: DeviceCollectives, shard: DeviceShard, x: np.ndarray,
                   y: np.ndarray, step: int, *, rng=None) -> StepResult:
        """One training step of one device: its stage's ticks (forwards and backwards of
        every microbatch, gradients accumulated and reduced), the shared tables'
        gradient sum over stage, the optimizer on its parameters.

        Args:
            core, comm, shard, step, rng: as ``ShardedTransformer.train_step``.
            x: (b, T) token ids, b = global batch / (data x fsdp), a multiple of M.
            y: (b, T) next-token labels.

        Returns:
            StepResult: the mean loss over the device's microbatches (every stage
            reports it), its new shard, where the optimizer's records start.

        Raises:
            ValueError: comm or shard not of this mesh or device; b not a multiple of M.
        """
        self._check(comm, shard)
        work = _TransformerStage(self, core, comm, shard, x, y, training=True)
        point = run_ticks(self.schedule, shard.coords.stage, comm, core, work, tag="pipeline",
                          itemsize=wire_itemsize(core))
        comm.align(point)
        grads = self._share(core, comm, shard.coords.stage, work.chunks)
        update_start = len(core.records)
        params, state = self._update(core, comm, grads, shard, step)
        return StepResult(work.loss(), DeviceShard(shard.coords, params, state), update_start)

    def _share(self, core, comm: DeviceCollectives, stage: int,
               chunks: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sum the shared tables' gradient chunks over stage (one allreduce; the stages
        that do not hold them add zeros)."""
        if not self.shared_keys or self.stages == 1:
            return chunks
        widths = [self._chunk_count([k]) for k in self.shared_keys]
        after = len(core.records)
        if not core.execute:
            comm.allreduce("stage", timing_zeros((sum(widths),), _F32), tag="shared grads",
                           kind="grad_reduce", after_record=after)
            return chunks
        buf = np.concatenate([np.asarray(chunks[k], _F32) if k in chunks else np.zeros(w, _F32)
                              for k, w in zip(self.shared_keys, widths, strict=True)])
        total = comm.allreduce("stage", buf, tag="shared grads", kind="grad_reduce",
                               after_record=after)
        parts = np.split(total, np.cumsum(widths)[:-1])
        return {**chunks, **{k: p.astype(self.storage, copy=False)
                             for k, p in zip(self.shared_keys, parts, strict=True) if k in chunks}}

    def evaluate(self, core, comm: DeviceCollectives, shard: DeviceShard, x: np.ndarray,
                 y: np.ndarray) -> EvalSums:
        """Eval-mode sums of the last stage over this device's examples (the forwards of
        its microbatches through every stage); zeros on the other stages."""
        self._check(comm, shard)
        if x.shape[0] == 0:
            return EvalSums(0.0, 0, 0)
        work = _TransformerStage(self, core, comm, shard, x, y, training=False)
        run_ticks(self.eval_schedule, shard.coords.stage, comm, core, work, tag="eval",
                  itemsize=wire_itemsize(core))
        return work.eval_sums


class _TransformerStage:
    """One device's stage of one step (:class:`StageWork`): the forwards and backwards
    of its chunks for each microbatch, the caches between them, the gradient
    accumulators and their reduction, the microbatches' losses."""

    def __init__(self, program: PipelinedTransformer, core, comm, shard: DeviceShard,
                 x: np.ndarray, y: np.ndarray, *, training: bool):
        p = self.p = program
        if x.shape[0] % p.microbatches:
            raise ValueError(f"{x.shape[0]} examples per device do not split into "
                             f"{p.microbatches} microbatches")
        self.core, self.comm, self.shard, self.training = core, comm, shard, training
        self.stage, self.b = shard.coords.stage, x.shape[0] // p.microbatches
        self.x, self.y = x, y
        cfg = p.model.config
        t = cfg.sequence_length // (p.tensor if p.sequence_parallel else 1)
        self.act_shape = (self.b, t, cfg.embed_dim)                      # (b, T', C)
        self.hooks = {ph: p._hooks(core, comm, ph) for ph in (("fwd", "bwd") if training
                                                               else ("eval",))}
        self.caches: dict[tuple[int, int], list] = {}
        self.dy: dict[int, np.ndarray] = {}
        self.losses: dict[int, float] = {}
        self.grads: dict[str, np.ndarray] = {}
        self.chunks: dict[str, np.ndarray] = {}
        self.bucket: dict[str, np.ndarray] = {}                          # gradients to reduce
        self.done = [0] * p.repeats                                      # backwards per chunk
        #: with ``fsdp_ag_once``: layer -> its gathered params, kept for the step
        self.gathered: dict[int, dict[str, np.ndarray]] | None = {} if p.fsdp_ag_once else None
        self.eval_sums = EvalSums(0.0, 0, 0)

    def buffer_elements(self, phase: str) -> int:
        return math.prod(self.act_shape) + (1 if phase == "bwd" else 0)

    def _flat(self, a: np.ndarray, extra: float | None = None) -> np.ndarray:
        """a as the flat float32 buffer a permute sends (``extra`` appended)."""
        n = a.size + (0 if extra is None else 1)
        if not self.core.execute:
            return timing_zeros((n,), _F32)
        flat = np.ascontiguousarray(a, dtype=_F32).reshape(-1)
        return flat if extra is None else np.append(flat, _F32(extra))

    def _unflat(self, buf: np.ndarray) -> np.ndarray:
        n = math.prod(self.act_shape)
        if not self.core.execute:
            return timing_zeros(self.act_shape, _F32)
        return np.asarray(buf[:n], dtype=_F32).reshape(self.act_shape)

    def _params(self, i: int, phase: str) -> dict[str, np.ndarray] | None:
        """Layer i's gathered params with ``fsdp_ag_once`` (gathered at their first use
        in the step, then kept); None without it (the layer gathers them itself)."""
        if self.gathered is None:
            return None
        if i not in self.gathered:
            self.gathered[i] = self.p._gather(self.core, self.comm, self.shard, i, phase)
        return self.gathered[i]

    def _microbatch(self, m: int) -> slice:
        return slice(m * self.b, (m + 1) * self.b)

    def forward(self, op: PipeOp, x: np.ndarray | None) -> np.ndarray | None:
        p, m = self.p, op.microbatch
        v = p.schedule.virtual(self.stage, op)
        if v == 0:
            h = self.x[self._microbatch(m)]                                # (b, T) token ids
        else:
            assert x is not None, "a later virtual stage's forward receives its input"
            h = self._unflat(x)                                            # (b, T', C)
        phase = "fwd" if self.training else "eval"
        caches = []
        for i in p.chunks[v]:
            h, cache = p._layer_forward(self.core, self.comm, self.shard, i, h, phase,
                                        self.hooks[phase], training=self.training,
                                        params=self._params(i, phase))
            caches.append(cache)
        if v < len(p.chunks) - 1:
            if self.training:
                self.caches[(m, op.repeat)] = caches
            return self._flat(h)
        labels = self.y[self._microbatch(m)][:, p.sequence_slice(self.shard.coords)]
        loss, dy = p.local_model.output_loss(self.core, h, labels)
        if self.training:
            self.caches[(m, op.repeat)] = caches
            self.dy[m], self.losses[m] = dy, float(_F32(loss))
        else:
            correct = (int((np.asarray(h).argmax(axis=-1) == labels).sum())
                       if self.core.execute else 0)
            self.eval_sums += EvalSums(float(loss) * labels.size, correct, int(labels.size))
        return None

    def backward(self, op: PipeOp, dy: np.ndarray | None) -> np.ndarray | None:
        p, m, core = self.p, op.microbatch, self.core
        v = p.schedule.virtual(self.stage, op)
        if dy is None:
            g: np.ndarray | None = self.dy.pop(m)
        else:
            g = self._unflat(dy)
            self.losses[m] = float(dy[-1]) if core.execute else 0.0
        caches = self.caches.pop((m, op.repeat))
        self.done[op.repeat] += 1
        last = self.done[op.repeat] == p.microbatches
        for i, cache in zip(reversed(p.chunks[v]), reversed(caches), strict=True):
            g = p._layer_backward(core, self.comm, self.shard, i, cache, g, self.hooks["bwd"],
                                  self.grads, "accumulate", params=self._params(i, "bwd"))
            if last:
                if self.gathered is not None:  # its last use in the step
                    self.gathered.pop(i)
                self.bucket.update({k: self.grads.pop(k) for k in p._reduce_at[self.stage][i]})
                if i in p._bucket_closers[self.stage]:
                    self.chunks.update(p._reduce(core, self.comm, p.local_model.layers[i].name,
                                                 self.bucket))
                    self.bucket = {}
        return None if v == 0 or g is None else self._flat(g, self.losses[m])

    def loss(self) -> float:
        """The mean of the microbatches' losses (float32 values, as they travel)."""
        return float(np.mean([self.losses[m] for m in range(self.p.microbatches)]))
