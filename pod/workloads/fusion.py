"""Fusion: the transformer's elementwise work fused into its matmuls, as XLA does on a TPU.

XLA fuses elementwise producers into the operand of the dot that consumes
them (a prologue) and elementwise consumers into the output of the dot that
produces them (an epilogue) [XLA-F]; the fused kernel reads the matmul's
operands and writes its outputs once, and the VPU work runs beside the MXU.
So a fused op moves no HBM bytes of its own and costs only what its VPU time
adds beyond the kernel's: the kernel costs max(MXU, VPU, HBM), HBM being the
matmul's operands and outputs (``chip.TensorCore.vector(fused=...)``,
``OpRecord.fused_into``). Its record stays (per-op breakdowns keep their
rows); it follows its matmul's record.

The rule (``fusion: true``, the transformer's default):

=============================  ======================================================
op                             fused into
=============================  ======================================================
norm (its per-token statistic  the next matmul: the q / k / v (or fused qkv)
and the normalisation)         projection, the MLP input projection, the output
                               layer (prologue; a row's statistic over C is taken
                               inside the tile the matmul reads, its K dimension)
q / k / v biases, RoPE (and    the projection that produced them (epilogue), when
its sin / cos tables)          it ran in this pass; a RoPE recomputed from a kept
                               projection is an op of its own in front of the flash
                               kernel (XLA does not fuse into a Pallas call) or a
                               prologue of the dot-product scores
softmax (dot-product           the scores product (epilogue) when it ran, else the
attention)                     p.v product (prologue)
MLP activation, its biases     the MLP input projection (epilogue) when it ran, else
                               the next matmul (the output projection, or in
                               backward the weight gradient d_wo)
parallel block: attention +    the MLP output projection (epilogue)
MLP output sum
residual adds, output          the next matmul (prologue): the next norm's consumer;
biases (after the tensor-      after a tensor allreduce no epilogue is possible
parallel sum)
backward: activation, softmax  the matmul producing their input gradient (epilogue)
and RoPE gradients, sums of    or consuming it (prologue), as in forward
input-gradient parts, norm dx,
residual adds
=============================  ======================================================

Unfused (ops of their own, with their HBM traffic): reductions across tokens
(a norm's scale gradient, bias gradients), the embedding gather and its
scatter-add gradient, the loss (log-softmax over the vocabulary and its
gradient), flash attention's di = rowsum(dO * O), the tied embedding's
gradient sum, the gradient scaling and the optimizer. The flash kernel's own
softmax is always fused (it is one Pallas kernel, ``pod.workloads.flash``).

A fused kernel writes the tensors backward keeps (a norm's x_hat, the
residual stream) beside its output; those writes are not costed (each is one
(T, C) or (T, F) array beside a matmul of T x C x C or more work, compute-bound
at these sizes). ``fusion: false`` costs every elementwise op as its own op
with its HBM round trip (the emulator's costing before fusion).

Sources: [XLA-F] the XLA compiler's fusion passes (``InstructionFusion``:
elementwise producers fused into their consumers; output fusion of a dot
with its elementwise consumers). The table is this emulator's reading of
them, not a measured profile: which neighbour an op joins changes only how
much of its VPU time hides, never its HBM bytes (none either way).
"""

from __future__ import annotations

__all__ = ["prologue", "epilogue", "after"]


def prologue(enabled: bool) -> str | None:
    """Fused into the next matmul recorded (``chip.FUSIONS`` "next"), or None."""
    return "next" if enabled else None


def epilogue(enabled: bool) -> str | None:
    """Fused into the last matmul recorded ("previous"), or None."""
    return "previous" if enabled else None


def after(enabled: bool, producer_ran: bool, otherwise: str | None = "next") -> str | None:
    """An op consuming a matmul's output: its epilogue when the matmul ran in this
    pass, else ``otherwise`` ("next": the next matmul's prologue; None: an op of
    its own); None without fusion."""
    if not enabled:
        return None
    return "previous" if producer_ran else otherwise
