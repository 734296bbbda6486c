"""Loss functions: value and gradient with respect to the logits."""

from __future__ import annotations

import numpy as np


def _log_softmax(z: np.ndarray) -> np.ndarray:
    shifted = z - z.max(axis=1, keepdims=True)                           # (B, K), max 0
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def softmax_cross_entropy(core, logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean softmax cross-entropy over the batch, numerically stable.

    log p = z - max(z) - log(sum(exp(z - max(z)))), so exp never overflows.
    The work runs on the VPU through ``core.vector`` (exp and log are
    transcendental).

    Args:
        core: a ``chip.TensorCore`` (or anything with its ``vector`` method).
        logits: (B, K) unnormalised scores.
        labels: (B,) integer classes in [0, K).

    Returns:
        (loss, dlogits): the mean loss as a Python float, and its gradient
        (B, K) = (softmax(logits) - onehot(labels)) / B in the logits' dtype.

    Raises:
        ValueError: shapes disagree or a label is out of range.
    """
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"softmax_cross_entropy expects logits (B, K) and labels (B,), "
                         f"got {logits.shape} and {labels.shape}")
    b, k = logits.shape
    if b and (labels.min() < 0 or labels.max() >= k):
        raise ValueError(f"labels must be in [0, {k}), got range [{labels.min()}, {labels.max()}]")
    logp = core.vector("xent/log_softmax", _log_softmax, logits,
                       ops_per_element=5.0, transcendental=True)          # (B, K)
    rows = np.arange(b)
    loss = -float(logp[rows, labels].mean())

    def grad(lp):
        g = np.exp(lp)                                                    # softmax (B, K)
        g[rows, labels] -= 1.0
        g *= np.asarray(1.0 / b, lp.dtype)
        return g

    dlogits = core.vector("xent/grad", grad, logp, ops_per_element=3.0, transcendental=True)
    return loss, dlogits
