"""Flash attention: the blocked causal attention kernel of the TPU stacks, numerics and cost.

FlashAttention-2 [FA2] as the TPU Pallas kernels run it ([PALLAS-FA]
``jax.experimental.pallas.ops.tpu.flash_attention``, MaxText ``attention:
flash``; the splash kernel of tpu-recipes is the same blocking): the queries
of a head are cut into blocks of ``block`` rows, the keys and values into
blocks of ``block`` columns. Per query block the kernel walks the key blocks
with an online softmax (a running row maximum m and row sum l), so no T x T
tensor ever reaches HBM; it writes the output and the per-row statistics.
Causal masking by blocks: a key block wholly after the query block's last
position is skipped; a block the diagonal crosses is computed whole and
masked; the others are computed unmasked.

Backward is Pallas's two kernels: ``dkv`` (per key block, over the query
blocks: dV += P^T dO, dK += dS^T Q) and ``dq`` (per query block: dQ += dS K).
Each recomputes its blocks' scores S = Q K^T and probabilities P = exp(S -
lse) from q, k and the row statistics, and dP = dO V^T, with dS = P (dP - di)
and di = rowsum(dO * O) computed once before them. So a computed block costs
2 block products forward and 7 backward (4 in ``dkv``, 3 in ``dq``), against
2 and 4 for attention that keeps its probabilities. Splash attention's fused
backward kernel (MaxText ``sa_use_fused_bwd_kernel``; [SPLASH]
``_splash_attention_bwd_dkv`` with ``use_fused_bwd_kernel``) is the ``dkv``
kernel that also forms dQ from the dS it already has (``ds.T @ k``): 5 block
products, not 7; it writes one partial dQ per key block (``dq_unreduced``, the
query's dtype), which XLA then sums. Each backward kernel has its own blocks
(``sa_block_q_dkv``, ``sa_block_kv_dkv``, ``sa_block_q_dq``, ``sa_block_kv_dq``:
:class:`BackwardBlocks`), and a larger query block computes more of the
causal triangle (``causal_blocks``).

Grouped-query attention: the G query heads of a kv head are G heads of the
kernel that read the same key / value head; dK and dV sum over them.

Cost (from shapes alone, so a timing-only core records what an executing one
does), per kernel one MXU record (``TensorCore.account_kernel``: its block
products, its HBM traffic) and its softmax work as VPU records fused into it
(``fused="previous"``: they add only what the MXU and HBM time does not
cover). HBM traffic is q, k, v (and dO), the outputs and the per-row
statistics, each once: a kernel re-reads a key / value block per query block
from VMEM, and one head's K and V (T x Dh in bf16 each: 4 MiB at T 8192,
Dh 128) fit the 16-128 MiB of VMEM of every generation (chip/spec.py).
VPU element-ops per score element computed: forward 4 (scale, running max,
subtract, row sum) plus one per masked element and one transcendental (exp);
per row visit of a block Dh (rescale the accumulator) and one exp (the
correction); per output row Dh (divide by l). Backward, each of the two
kernels: 5 (scale, subtract lse, dP - di, times P, times scale) plus one per
masked element and one exp. di: 2 per element of dO, an op of its own.

Sources: [FA2] Dao 2023, "FlashAttention-2"; [PALLAS-FA] jax
``jax/experimental/pallas/ops/tpu/flash_attention.py`` (``_flash_attention_bwd_dkv``,
``_flash_attention_bwd_dq``); [SPLASH] jax
``jax/experimental/pallas/ops/tpu/splash_attention/splash_attention_kernel.py``
(jax 0.10.2: ``BlockSizes``, ``_flash_attention_dkv_kernel``,
``_splash_attention_bwd``); block sizes: ``FLASH_BLOCK_SIZE``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from chip import to_bf16

__all__ = ["FLASH_BLOCK_SIZE", "STATS_BYTES_PER_ROW", "CausalBlocks", "causal_blocks",
           "flash_forward", "flash_backward", "record_flash_forward", "record_flash_backward",
           "record_flash_backward_kernel", "BACKWARD_KERNELS", "FUSED_BACKWARD_KERNEL",
           "KERNEL_PRODUCTS", "FORWARD_PRODUCTS", "BACKWARD_PRODUCTS", "BackwardBlocks"]

FLASH_BLOCK_SIZE = 512
"""Query and key block of the flash kernel, rows and columns: MaxText's splash
attention block sizes (``sa_block_q``, ``sa_block_kv``, ``sa_block_q_dkv``,
``sa_block_kv_dkv``, ``sa_block_q_dq``, ``sa_block_kv_dq``: all 512 in
``MaxText/configs/base.yml`` at tpu-recipes-v0.1.4,
../shared/reference/maxtext/base-tpu-recipes-v0.1.4.yml). A sequence shorter
than a block is one block."""

STATS_BYTES_PER_ROW = 8
"""The row statistics the forward kernel writes for backward: the running
maximum m and the sum l, float32 each [PALLAS-FA] (``save_residuals``)."""

FORWARD_PRODUCTS = 2   # S = Q K^T, O += P V per computed block
BACKWARD_PRODUCTS = 7  # dkv: S, dP, dV, dK; dq: S, dP, dQ

#: Each backward kernel's block products per computed block ([PALLAS-FA], [SPLASH]),
#: as ``_block_products`` kinds: "qk" (S = Q K^T, and dP = dO V^T of the same shape),
#: "t" (dV += P^T dO, dK += dS^T Q: a transposed block), "pv" (dQ += dS K). "fused":
#: splash's fused backward kernel, ``dkv`` and its dQ (module docstring).
KERNEL_PRODUCTS = {"dkv": ("qk", "qk", "t", "t"), "dq": ("qk", "qk", "pv"),
                   "fused": ("qk", "qk", "t", "t", "pv")}
FUSED_BACKWARD_KERNEL = "fused"


@dataclass(frozen=True)
class BackwardBlocks:
    """The flash backward's kernels and their (query, key / value) blocks, as MaxText's
    splash attention configures them.

    Attributes:
        dkv: the ``dkv`` kernel's blocks (``sa_block_q_dkv``, ``sa_block_kv_dkv``);
            None: the forward's.
        dq: the ``dq`` kernel's blocks (``sa_block_q_dq``, ``sa_block_kv_dq``); None:
            the forward's; unused when ``fused``.
        fused: splash's fused backward kernel (``sa_use_fused_bwd_kernel``): one kernel
            of 5 block products on the ``dkv`` blocks instead of two of 7.
    """

    dkv: tuple[int, int] | None = None
    dq: tuple[int, int] | None = None
    fused: bool = False

    def kernels(self, block: int, block_kv: int | None) -> tuple[tuple[str, int, int], ...]:
        """(kernel, query block, key / value block) of each backward kernel, given the
        forward's blocks (``block_kv`` None: ``block``)."""
        forward = (block, block if block_kv is None else block_kv)
        dkv = self.dkv or forward
        if self.fused:
            return ((FUSED_BACKWARD_KERNEL, *dkv),)
        return (("dkv", *dkv), ("dq", *(self.dq or forward)))


@dataclass(frozen=True)
class CausalBlocks:
    """The blocks a causal flash kernel computes over T positions, per head.

    Attributes:
        steps: T.
        block: the query block used (rows), min(requested, T).
        shapes: ((rows, cols, masked), count) of the computed blocks, sorted
            (a T that is not a multiple of the block has smaller edge blocks).
        block_kv: the key / value block used (columns), min(requested, T).
    """

    steps: int
    block: int
    shapes: tuple[tuple[tuple[int, int, bool], int], ...]
    block_kv: int = 0

    @property
    def score_elements(self) -> int:
        """Score elements computed per head: the sum of rows x cols."""
        return sum(r * c * n for (r, c, _), n in self.shapes)

    @property
    def masked_elements(self) -> int:
        """Score elements in blocks the diagonal crosses (computed, then masked)."""
        return sum(r * c * n for (r, c, masked), n in self.shapes if masked)

    @property
    def row_visits(self) -> int:
        """Rows of a query block times the key blocks it visits, summed."""
        return sum(r * n for (r, _, _), n in self.shapes)


def causal_blocks(steps: int, block: int = FLASH_BLOCK_SIZE,
                  block_kv: int | None = None) -> CausalBlocks:
    """The computed blocks of causal attention over ``steps`` positions.

    Query block i holds positions [i b, i b + rows), key block j [j c, j c +
    cols) (c = ``block_kv``, b by default: MaxText's ``sa_block_q`` and
    ``sa_block_kv``); it is computed when its first key is at or before the
    query block's last position, masked when its last key is after the block's
    first position.

    Raises:
        ValueError: steps or a block below 1.
    """
    block_kv = block if block_kv is None else block_kv
    if steps < 1 or block < 1 or block_kv < 1:
        raise ValueError(f"causal blocks need steps and block >= 1, got {steps}, {block} and "
                         f"{block_kv}")
    b, c = min(block, steps), min(block_kv, steps)
    counts: Counter = Counter()
    for i0 in range(0, steps, b):
        rows = min(b, steps - i0)
        for j0 in range(0, i0 + rows, c):
            cols = min(c, steps - j0)
            counts[(rows, cols, j0 + cols - 1 > i0)] += 1
    return CausalBlocks(steps, b, tuple(sorted(counts.items())), c)


def _rounder(rounding: bool):
    return to_bf16 if rounding else (lambda a: a)


def _future(i0: int, rows: int, j0: int, cols: int) -> np.ndarray:
    """(rows, cols) True where key j0 + c is after position i0 + r."""
    return (j0 + np.arange(cols))[None, :] > (i0 + np.arange(rows))[:, None]


def flash_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, block: int,
                  rounding: bool) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention by blocks with an online softmax.

    Args:
        q: (N, G*T, Dh) queries, the G heads of a kv head one after another.
        k, v: (N, T, Dh) keys and values.
        scale: 1 / sqrt(Dh).
        block: rows / columns per block.
        rounding: round the inputs of every block product to bf16 (the MXU's
            bf16 numerics; accumulation in the inputs' dtype).

    Returns:
        (o (N, G*T, Dh), lse (N, G*T)): the output and the row log-sum-exp
        m + log(l), the statistics backward reads.
    """
    n, gt, dh = q.shape
    t = k.shape[1]
    g, r = gt // t, _rounder(rounding)
    qr, kr, vr = r(q.reshape(n, g, t, dh)), r(k)[:, None], r(v)[:, None]  # (N,G,T,Dh), (N,1,T,Dh)
    o = np.empty((n, g, t, dh), q.dtype)
    lse = np.empty((n, g, t), q.dtype)
    for i0 in range(0, t, block):
        qi = qr[:, :, i0:i0 + block]                                      # (N, G, rows, Dh)
        rows = qi.shape[2]
        m = np.full((n, g, rows), -np.inf, q.dtype)
        row_sum = np.zeros((n, g, rows), q.dtype)  # the softmax denominators (the paper's l)
        acc = np.zeros((n, g, rows, dh), q.dtype)
        for j0 in range(0, i0 + rows, block):
            kj, vj = kr[:, :, j0:j0 + block], vr[:, :, j0:j0 + block]     # (N, 1, cols, Dh)
            s = np.matmul(qi, kj.transpose(0, 1, 3, 2)) * np.asarray(scale, q.dtype)
            if j0 + kj.shape[2] - 1 > i0:                                  # the diagonal crosses it
                s = np.where(_future(i0, rows, j0, kj.shape[2]), -np.inf, s)
            m_new = np.maximum(m, s.max(axis=-1))
            p = np.exp(s - m_new[..., None])                              # (N, G, rows, cols)
            correction = np.exp(m - m_new)
            row_sum = row_sum * correction + p.sum(axis=-1)
            acc = acc * correction[..., None] + np.matmul(r(p), vj)
            m = m_new
        o[:, :, i0:i0 + rows] = acc / row_sum[..., None]
        lse[:, :, i0:i0 + rows] = m + np.log(row_sum)
    return o.reshape(n, gt, dh), lse.reshape(n, gt)


def flash_backward(q, k, v, o, lse, do, scale: float, block: int, rounding: bool
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradients of ``flash_forward``, recomputing each block's scores.

    Args:
        q, o, do: (N, G*T, Dh) queries, outputs and output gradients.
        k, v: (N, T, Dh).
        lse: (N, G*T) from ``flash_forward``.
        scale, block, rounding: as ``flash_forward``.

    Returns:
        (dq (N, G*T, Dh), dk (N, T, Dh), dv (N, T, Dh)): the gradients of the
        raw inputs (dk, dv summed over the G query heads of each kv head).
    """
    n, gt, dh = q.shape
    t = k.shape[1]
    g, r = gt // t, _rounder(rounding)
    shape = (n, g, t, dh)
    di = (do.reshape(shape) * o.reshape(shape)).sum(axis=-1)             # (N, G, T)
    qr, dor = r(q.reshape(shape)), r(do.reshape(shape))
    kr, vr = r(k)[:, None], r(v)[:, None]
    lse = lse.reshape(n, g, t)
    dq = np.zeros(shape, q.dtype)
    dk, dv = np.zeros(k.shape, q.dtype), np.zeros(v.shape, q.dtype)
    sc = np.asarray(scale, q.dtype)
    for i0 in range(0, t, block):
        rows = min(block, t - i0)
        qi, doi = qr[:, :, i0:i0 + rows], dor[:, :, i0:i0 + rows]
        for j0 in range(0, i0 + rows, block):
            kj, vj = kr[:, :, j0:j0 + block], vr[:, :, j0:j0 + block]
            cols = kj.shape[2]
            s = np.matmul(qi, kj.transpose(0, 1, 3, 2)) * sc
            if j0 + cols - 1 > i0:
                s = np.where(_future(i0, rows, j0, cols), -np.inf, s)
            p = np.exp(s - lse[:, :, i0:i0 + rows, None])                 # (N, G, rows, cols)
            dv[:, j0:j0 + cols] += np.matmul(r(p).transpose(0, 1, 3, 2), doi).sum(axis=1)
            dp = np.matmul(doi, vj.transpose(0, 1, 3, 2))
            ds = r(p * (dp - di[:, :, i0:i0 + rows, None]) * sc)
            dq[:, :, i0:i0 + rows] += np.matmul(ds, kj)
            dk[:, j0:j0 + cols] += np.matmul(ds.transpose(0, 1, 3, 2), qi).sum(axis=1)
    return dq.reshape(n, gt, dh), dk, dv


def _block_products(blocks: CausalBlocks, dh: int, heads: int, products) -> list[tuple]:
    """(m, k, n, batch) of each block product kind over the computed blocks;
    ``products``: "qk" (rows x Dh x cols), "pv" (rows x cols x Dh), "t" (cols x
    rows x Dh, a transposed block's product)."""
    dims = {"qk": lambda r, c: (r, dh, c), "pv": lambda r, c: (r, c, dh),
            "t": lambda r, c: (c, r, dh)}
    return [(*dims[kind](r, c), heads * count) for kind in products
            for (r, c, _), count in blocks.shapes]


def _softmax_ops(core, name: str, blocks: CausalBlocks, heads: int, per_score: float,
                 extra: int = 0, extra_exp: int = 0) -> None:
    """A kernel's fused VPU records: ``per_score`` plain ops per score element, one
    per masked element, ``extra`` more; and one exp per score element plus
    ``extra_exp``."""
    scores = heads * blocks.score_elements
    plain = per_score * scores + heads * blocks.masked_elements + extra
    core.account_vector(f"{name}/softmax", scores, 0, ops_per_element=plain / scores,
                        fused="previous")
    core.account_vector(f"{name}/exp", scores + extra_exp, 0, transcendental=True,
                        fused="previous")


def record_flash_forward(core, name: str, batch: int, heads: int, kv_heads: int, steps: int,
                         head_dim: int, block: int = FLASH_BLOCK_SIZE,
                         block_kv: int | None = None) -> None:
    """Records the forward kernel's cost (module docstring) on ``core``.

    Args:
        core: the TensorCore.
        name: the layer's name; records "<name>/flash_fwd" and its fused
            "<name>/flash_fwd/softmax", ".../exp".
        batch, heads, kv_heads, steps, head_dim: B, H, K, T, Dh.
        block, block_kv: the query and key / value blocks (``causal_blocks``).
    """
    blocks = causal_blocks(steps, block, block_kv)
    bh, ob, out = batch * heads, core.operand_bytes, core.output_bytes
    q_elements, kv_elements = batch * steps * heads * head_dim, batch * steps * kv_heads * head_dim
    hbm = (q_elements + 2 * kv_elements) * ob + q_elements * out + bh * steps * STATS_BYTES_PER_ROW
    core.account_kernel(f"{name}/flash_fwd", _block_products(blocks, head_dim, bh, ("qk", "pv")),
                        hbm)
    rows = bh * blocks.row_visits
    _softmax_ops(core, f"{name}/flash_fwd", blocks, bh, 4.0,
                 extra=head_dim * rows + head_dim * bh * steps, extra_exp=rows)


def record_flash_backward(core, name: str, batch: int, heads: int, kv_heads: int, steps: int,
                          head_dim: int, block: int = FLASH_BLOCK_SIZE,
                          block_kv: int | None = None,
                          backward: BackwardBlocks | None = None) -> None:
    """Records the backward's cost: di, then the ``dkv`` and ``dq`` kernels (or splash's
    fused one) with their fused softmax-gradient work (module docstring).

    Args:
        as ``record_flash_forward``; records "<name>/flash_bwd/di",
        "<name>/flash_bwd_dkv" and "<name>/flash_bwd_dq" (each with fused
        ".../softmax", ".../exp"), or with ``backward.fused`` "<name>/flash_bwd_fused"
        and the sum of its partial dQ, "<name>/flash_bwd/dq_sum".
        backward: the backward kernels' blocks (:class:`BackwardBlocks`); None: two
            kernels on the forward's blocks.
    """
    bh, out = batch * heads, core.output_bytes
    q_elements = batch * steps * heads * head_dim
    core.account_vector(f"{name}/flash_bwd/di", q_elements, 2 * q_elements * out + 4 * bh * steps,
                        ops_per_element=2.0)
    for kernel, rows, cols in (backward or BackwardBlocks()).kernels(block, block_kv):
        record_flash_backward_kernel(core, f"{name}/flash_bwd_{kernel}", kernel, batch, heads,
                                     kv_heads, steps, head_dim, rows, cols)
        if kernel == FUSED_BACKWARD_KERNEL:  # XLA sums the partial dQ of each key block
            partials = -(-steps // min(cols, steps))
            core.account_vector(f"{name}/flash_bwd/dq_sum", q_elements,
                                (partials + 1) * q_elements * core.operand_bytes,
                                ops_per_element=float(partials))


#: The backward's two Pallas kernels ([PALLAS-FA] ``_flash_attention_bwd_dkv``, ``_dq``).
BACKWARD_KERNELS = ("dkv", "dq")


def record_flash_backward_kernel(core, name: str, kernel: str, batch: int, heads: int,
                                 kv_heads: int, steps: int, head_dim: int,
                                 block: int = FLASH_BLOCK_SIZE,
                                 block_kv: int | None = None) -> None:
    """Records one backward kernel, ``dkv`` (dV += P^T dO, dK += dS^T Q), ``dq`` (dQ +=
    dS K) or splash's ``fused`` one (both), with its fused softmax-gradient work (module
    docstring): what an HLO module holds as one custom call each (``pod.hlo``).

    Args:
        core: the TensorCore.
        name: the kernel's record name (its fused ".../softmax", ".../exp" follow).
        kernel: one of :data:`BACKWARD_KERNELS` or :data:`FUSED_BACKWARD_KERNEL`.
        batch, heads, kv_heads, steps, head_dim, block, block_kv: as
            ``record_flash_forward`` (the kernel's own blocks).

    Raises:
        ValueError: an unknown kernel.
    """
    if kernel not in KERNEL_PRODUCTS:
        raise ValueError(f"flash backward kernel {kernel!r}: one of {', '.join(KERNEL_PRODUCTS)}")
    blocks = causal_blocks(steps, block, block_kv)
    bh, ob, out = batch * heads, core.operand_bytes, core.output_bytes
    q_elements, kv_elements = batch * steps * heads * head_dim, batch * steps * kv_heads * head_dim
    stats = bh * steps * (STATS_BYTES_PER_ROW + 4)                         # m, l and di, float32
    reads = (2 * q_elements + 2 * kv_elements) * ob + stats               # q, dO, k, v, m, l, di
    writes = {"dkv": 2 * kv_elements * out, "dq": q_elements * out,       # dK, dV; dQ; both, dQ
              "fused": 2 * kv_elements * out                              # one partial per key
              + -(-steps // blocks.block_kv) * q_elements * ob}[kernel]   # block, q's dtype
    core.account_kernel(name, _block_products(blocks, head_dim, bh, KERNEL_PRODUCTS[kernel]),
                        reads + writes)
    _softmax_ops(core, name, blocks, bh, 5.0)
