"""What a device program holds in HBM during a training step, as XLA's buffer assignment
keeps it: the pieces every program's ``memory`` (``pod.programs.contract``) is made of.

A jitted train step (MaxText's, [MT] ``train.py``; the XLA oracle's, tools/xla_oracle)
takes the parameters and the optimizer state as donated arguments (aliased to its
outputs: counted once) and allocates everything else as temporaries. What the
temporaries hold changes through the step, so the step's need is the largest of its
**phases**, each the persistent arguments plus what is live in it:

- **forward**: the activations the remat policy keeps (the scan's stacked residuals),
  a copy of the device's weights in the compute dtype (XLA converts the float32
  masters of the scanned layers to bf16 once and reuses them in backward), the weight
  array gathered for the matmul running and those gathered ahead (``prefetch_layers``;
  XLA all-gathers each weight array just before its matmul, the next one while it
  runs), a block's working set;
- **loss**: the kept activations and the weight copy, the output layer's weights
  gathered, the logits in the compute dtype (chunked over the tokens by
  ``num_vocab_tiling``; XLA fuses the float32 cast, the log-softmax and the gradient
  into the reductions and one fusion that writes the gradient in place of the logits);
- **backward**: the sharded gradients (the scan's accumulator, in the parameters'
  dtype: no layer's float32 gradient exists whole, the reduce-scatter runs on what the
  matmul wrote), the kept activations, the weight copy, the gathered weight arrays, the
  output layer's weight gradient or the logits' gradient, whichever XLA forms after the
  layers' backward (:func:`output_gradient_held`), one block's backward working set
  (:func:`backward_working_bytes`).

The optimizer update runs in place on the donated buffers, reading the gradients: it
needs no more than backward. Each rule was read from deviceless TPU compiles of the
oracle's reference with XLA's buffer assignment dumped (the values live at the peak,
by the jax op that made them; VALIDATION.md "Memory against XLA"); the plan is checked
against the oracle's peaks by ``benchmarks/memory_oracle.py``.

Sources: [XLA] ``compiled.memory_analysis()`` (argument, output, alias, temp and peak
bytes per device), ``--xla_dump_to`` (buffer assignment, live ranges); [MT]
AI-Hypercomputer/maxtext ``train.py``, ``layers/decoders.py`` (scanned layers, remat
policies), ``configs/base.yml`` (``weight_dtype``, ``cast_logits_to_fp32``,
``num_vocab_tiling``); [SB] "How to Scale Your Model", training chapter (FSDP gathers
bf16 weights ahead of their use).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pod.memory import DeviceMemory
from pod.workloads.model import activation_bytes_per_element

__all__ = ["Phase", "peak_memory", "compute_bytes", "gather_bytes", "backward_working_bytes",
           "output_gradient_held",
           "recomputed_attention_elements",
           "PREFETCH_LAYERS", "WINDOWED_TENSOR", "DOT_PRODUCT_LIVE_SCORES"]

#: Layers whose FSDP all-gather XLA's latency-hiding scheduler runs ahead of the layer
#: computing, when HBM allows (its async all-gather is issued one layer early; [SB]).
PREFETCH_LAYERS = 1

def compute_bytes(precision: str) -> int:
    """Bytes of an activation (and of a weight as the MXU reads it) under ``precision``:
    the workloads' ``activation_bytes_per_element`` (bf16 and int8 training compute in
    bf16, MaxText ``dtype: bfloat16``; fp32 in float32).

    Raises:
        ValueError: an unknown precision.
    """
    return activation_bytes_per_element(precision)


def gather_bytes(precision: str) -> int:
    """Bytes per weight an FSDP all-gather moves and the gathered layer holds: the
    compute dtype (XLA converts a float32 master before gathering it [SB]; int8 training
    gathers bf16 and quantises on the chip)."""
    return compute_bytes(precision)


#: From this tensor size on, XLA decomposes the reduce-scatters of the input projections'
#: gradients over tensor into their matmuls (windowed einsum, collective matmul): no
#: whole partial sum is held. Below it each is a full-width (T, C) array until reduced.
#: Read from the oracle's T1 (tensor 4: four such arrays live at the peak of a reduced
#: compile) and T4 (tensor 16: none fit the peak XLA reports).
WINDOWED_TENSOR = 16


#: T x T arrays per (tensor-local) head live at once in the backward of ``dot_product``
#: attention: the probabilities, the recomputed scores, their gradient and the scores'
#: gradient, each in the compute dtype. Read from the oracle's scheduled HLO of T9 (a
#: 22B with dot-product attention on v4-128, ``tools/xla_oracle/hlo/T9.hlo.txt.gz``:
#: four ``bf16[16,24,1024,1024]`` live at the backward body's ``fusion.420``; the peak
#: of a reduced compile of it, fewer layers, held three), the one model of the oracle
#: with this kernel (M3, T9-b32 are the same model): a count read from one compile, not
#: a fit. With 4, T9 and M3 plan 8% below XLA's peak; with 3, 12%.
DOT_PRODUCT_LIVE_SCORES = 4


def output_gradient_held(tied: bool, offloaded: bool, logits_bytes: int,
                         table_bytes: int) -> tuple[str, int]:
    """What of the output layer's backward XLA holds through the layers' backward loop:
    (the plan's item, its bytes).

    The loss's gradient (the logits' gradient, b T V / tensor) feeds two products: the
    output layer's input gradient, which the layers' backward needs first, and its weight
    gradient (V x C), which nothing needs until the update. Where XLA's scheduler puts
    the second decides what lives through the layers' backward: before the loop, the
    weight gradient (the logits' gradient freed); after it, the logits' gradient. Read
    from the scheduled HLO of the 20 oracle compiles committed in
    ``tools/xla_oracle/hlo/`` (where in the ENTRY computation the product named
    ``transpose(jvp(bte,ev->btv))`` that writes the V x C array stands against the
    backward ``while``):

    - no tensor offloaded to host: before the loop in 12 of 16 (T1, T2, T3, T4, M1, M2,
      M3, T5-full, llama2-7b-full-b4, T8, T8-dropless, mixtral-v5p-128-dropless; tied and
      untied, remat full and minimal, v4, v5e, v5p and v6e), after it in T9,
      T9-untied-flash, T1-untied-sequential and gpt-style-v5p-64;
    - host offload (the layer input or projections offloaded): after the loop in 4 of 4
      (T5, T5-qkv_proj_offloaded, T6, T7).

    So the plan holds the weight gradient, whole (V x C, the bytes of ``table_bytes``, as
    XLA's fsdp all-reduce writes it), unless the remat policy offloads, and then the
    logits' gradient; tied embeddings hold the table's gradient either way (no tied
    configuration offloads among the compiles). The choice is XLA's scheduler's and the
    four exceptions show it is not decided by the config alone (T9 and M3 are the same
    model and per-slice mesh and choose differently): a majority read, not a law.

    Args:
        tied: the output layer is the embedding table.
        offloaded: the remat policy keeps some activation in host memory.
        logits_bytes: the logits' gradient on the device (its chunk with
            ``num_vocab_tiling``).
        table_bytes: the output layer's weight gradient, whole, in the compute dtype.

    Returns:
        ("embedding gradient" | "output kernel gradient" | "logits gradient", bytes).
    """
    if tied:
        return ("embedding gradient", table_bytes)
    if offloaded:
        return ("logits gradient", logits_bytes)
    return ("output kernel gradient", table_bytes)


def backward_working_bytes(block: Any, shape: tuple[int, int], act: int, tensor: int) -> int:
    """Bytes per example of one block's backward working set at the step's peak, as XLA
    schedules it (deviceless compiles of the oracle's reference, VALIDATION.md "Memory
    against XLA"): the residual stream's gradient and the block input's (two (T, C)
    arrays, whole over tensor) and the larger of

    - the MLP's part: its input products and the gradient of its activation (m + 1
      arrays of one product's width, T F / tensor; an MoE's, of its dispatch slots x F,
      2 m + 1: the recomputed products, the activation's output and gradient and the
      products' gradients, which XLA does not fuse into the batched expert einsums:
      T8's committed HLO holds six at its backward body's peak by a liveness walk and
      five by XLA's own total; with 2 m + 1 T8 and the three other Mixtral compiles
      plan +2.4 to +2.6% of XLA's peak, with m + 1 -5.7 to -14.4%: one model's rule;
      under dense dropless, every expert on every token, 2 m: the scheduled HLO of
      ``T8-dropless`` and ``mixtral-v5p-128-dropless`` holds four bf16[b,T,8,14336] at the
      backward body's peak, the output einsum's backward (``fusion.430`` / ``434``):
      the recomputed u0 and u1 and that einsum's two results) and,
      with 1 < tensor < ``WINDOWED_TENSOR``, the partial sums over tensor of its input
      projections' input gradient (m (T, C) arrays);
    - the attention's: with dot-product attention ``DOT_PRODUCT_LIVE_SCORES`` arrays of
      H T T / tensor (the scores, their softmax and the gradients; flash attention keeps
      no T x T array) and, with 1 < tensor < ``WINDOWED_TENSOR``, the partial sums of the
      q, k, v (or fused qkv) projections' input gradient (3 or 1 (T, C) arrays).

    In a ``parallel`` block both parts read the same normalised input, so their
    backward passes run side by side and every projection's partial sum is live at
    once (the larger of the products and the scores, plus all the partials: T1's compile,
    four partial sums at tensor 4). In a ``sequential`` block the MLP's backward ends
    before the attention's begins (the attention's output gradient is the MLP input's),
    so only the larger part is live: T1's model as a sequential block
    (``T1-untied-sequential``, ``tools/xla_oracle/hlo/``) holds 3.9 GiB less outside its
    stacked activations than T1 at the same shapes, where this rule says 3.25 GiB less.
    The attention's tensors the remat policy does not keep are recomputed before the
    MLP's backward and held through it (:func:`recomputed_attention_elements`).

    Args:
        block: the tensor-local ``TransformerBlock``.
        shape: (T, C) of its input (C whole).
        act: bytes of an activation.
        tensor: the tensor size.
    """
    steps, width = shape
    m = len(block.mlp.dot_keys)
    product = block.mlp.dot_elements(shape) // m                 # one input product
    attention = block.attention
    scores = 0 if attention.flash else DOT_PRODUCT_LIVE_SCORES * attention.heads * steps * steps
    projections = 1 if attention.fused_qkv else 3                   # q, k, v or qkv
    windowed = not 1 < tensor < WINDOWED_TENSOR                     # no whole partial sums
    mlp_partials, attention_partials = (0, 0) if windowed else (m, projections)
    residual = 2 * steps * width
    if block.moe:   # the expert products: 2 m + 1, or 2 m dense dropless
        products = (2 * m + (0 if block.mlp.dense_dropless else 1)) * product
    else:
        products = (m + 1) * product
    if block.parallel:
        return act * (max(products, scores) + residual
                      + (mlp_partials + attention_partials) * steps * width)
    held = recomputed_attention_elements(block, steps)     # through the MLP's backward
    return act * (max(products + mlp_partials * steps * width + held,
                      scores + attention_partials * steps * width) + residual)


def recomputed_attention_elements(block: Any, steps: int) -> int:
    """Elements per example of the attention's tensors a sequential block's backward
    holds through its MLP's backward: those the remat policy does not keep, recomputed
    with the block's forward at the start of its backward and read only by the
    attention's backward, which runs after the MLP's (its output gradient is the MLP
    input's). The queries, keys and values (``q``, ``k``, ``v``, or ``qkv`` fused) and the
    kernel's output (``attn``), T x the tensor-local widths; nothing under ``none``
    (everything is kept: counted as activations).

    Read from the scheduled HLO (``python -m tools.xla_oracle.liveness``) of
    ``gpt-style-v5p-64`` (remat full, ``tools/xla_oracle/hlo/``): at the backward body's
    peak (``fusion.627``, the MLP's backward) the recomputed q, k, v (``fusion.616``,
    ``618``, ``620``, bf16[4,32,2048,256]) and the splash kernel's output
    (``splash_mha_fwd_segmented_residuals.2`` element 3) are live beside the MLP's
    products; the same four in ``llama2-7b-full-b4`` at its body's peak
    (``fusion.367``), the kernel's output in ``T5-qkv_proj_offloaded`` (q, k, v kept on
    the host). In a parallel block the two backward passes are not ordered (T3's
    schedule runs the attention's first), so no such term there.

    Args:
        block: the tensor-local ``TransformerBlock``.
        steps: T.
    """
    kept = block.kept()
    if kept is None:
        return 0
    attention = block.attention
    q_kept = "q" in kept or "qkv" in kept
    kv_kept = ("k" in kept and "v" in kept) or "qkv" in kept
    return steps * ((0 if q_kept else attention.inner_dim)
                    + (0 if kv_kept else 2 * attention.kv_dim)
                    + (0 if "attn" in kept else attention.inner_dim))


@dataclass(frozen=True)
class Phase:
    """What is live, beside the parameters and optimizer state, in one phase of a step.

    Attributes:
        name: forward, loss, backward (or a pipeline's stage).
        gradients_bytes: gradient shards live (the accumulator, once allocated).
        activations_bytes: kept activations live in HBM.
        workspace: (item, bytes) of the rest live at once.
    """

    name: str
    gradients_bytes: int
    activations_bytes: int
    workspace: tuple[tuple[str, int], ...]

    @property
    def total_bytes(self) -> int:
        """Everything live in the phase but the persistent arguments."""
        return self.gradients_bytes + self.activations_bytes + sum(n for _, n in self.workspace)


def peak_memory(parameters_bytes: int, optimizer_state_bytes: int, phases: Iterable[Phase], *,
                host_activations_bytes: int = 0, prefetch_layers: int = 0,
                prefetch_layer_bytes: int = 0) -> DeviceMemory:
    """The device's memory at the step's peak: the persistent arguments and the phase
    with the most live (the first of equals), its items as the ``DeviceMemory``'s.

    Raises:
        ValueError: no phase.
    """
    phases = list(phases)
    if not phases:
        raise ValueError("peak_memory needs at least one phase")
    peak = max(phases, key=lambda p: p.total_bytes)
    return DeviceMemory(parameters_bytes=parameters_bytes, gradients_bytes=peak.gradients_bytes,
                        optimizer_state_bytes=optimizer_state_bytes,
                        activations_bytes=peak.activations_bytes,
                        host_activations_bytes=host_activations_bytes,
                        workspace=peak.workspace, prefetch_layers=prefetch_layers,
                        prefetch_layer_bytes=prefetch_layer_bytes, peak=peak.name)
