"""Loss functions: value and gradient with respect to the logits."""

from __future__ import annotations

import numpy as np

from pod.workloads.layers import vector_op


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
    logp = vector_op(core, "xent/log_softmax", _log_softmax, logits,
                     out=(logits.shape, logits.dtype), ops_per_element=5.0,
                     transcendental=True)                                 # (B, K)
    rows = np.arange(b)
    loss = -float(logp[rows, labels].mean())

    def grad(lp):
        g = np.exp(lp)                                                    # softmax (B, K)
        g[rows, labels] -= 1.0
        g *= np.asarray(1.0 / b, lp.dtype)
        return g

    dlogits = vector_op(core, "xent/grad", grad, logp, out=(logp.shape, logp.dtype),
                        ops_per_element=3.0, transcendental=True)
    return loss, dlogits


def sigmoid_binary_cross_entropy(core, logits: np.ndarray,
                                 labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean binary cross-entropy of sigmoid(logits) against 0/1 labels.

    The sigmoid of a "Dense(1, activation='sigmoid')" output layer is fused
    into the loss (Keras' ``from_logits=True`` form), which never takes the
    log of 0: loss = max(z, 0) - z * y + log(1 + exp(-|z|)).

    Args:
        core: a ``chip.TensorCore`` (its ``vector`` method costs the work).
        logits: (B, 1) or (B,) scores z.
        labels: (B,) labels in {0, 1}.

    Returns:
        (loss, dlogits): the mean loss as a Python float, and its gradient
        (sigmoid(z) - y) / B shaped like ``logits``, in the logits' dtype.

    Raises:
        ValueError: shapes disagree or a label is not 0 or 1.
    """
    z = logits.reshape(-1) if logits.ndim == 2 and logits.shape[1] == 1 else logits
    if z.ndim != 1 or labels.shape != z.shape:
        raise ValueError(f"sigmoid_binary_cross_entropy expects logits (B, 1) and labels (B,), "
                         f"got {logits.shape} and {labels.shape}")
    if labels.size and not np.all((labels == 0) | (labels == 1)):
        raise ValueError(f"binary labels must be 0 or 1, got values {np.unique(labels)[:5]}")
    b = z.shape[0]
    y = labels.astype(z.dtype)

    def value(z_, y_):
        return np.maximum(z_, 0) - z_ * y_ + np.log1p(np.exp(-np.abs(z_)))

    per_example = core.vector("bce/loss", value, z, y, ops_per_element=6.0, transcendental=True)
    loss = float(per_example.mean())

    def grad(z_, y_):
        e = np.exp(-np.abs(z_))
        s = np.where(z_ >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(z_.dtype, copy=False)
        return (s - y_) * np.asarray(1.0 / b, z_.dtype)

    dz = core.vector("bce/grad", grad, z, y, ops_per_element=5.0, transcendental=True)
    return loss, dz.reshape(logits.shape)
