"""Batch normalization with per-replica batch statistics.

In training mode each replica normalizes with the mean and variance of ITS
OWN shard of the batch, as the seed's Keras models did on TPU (TPUStrategy
does not synchronise batch-norm statistics across replicas unless asked to).
The running averages (``moving_mean`` / ``moving_variance``) are
non-trainable state, updated after each training forward pass and used in
evaluation mode. Defaults follow ``tf.keras.layers.BatchNormalization``:
momentum 0.99, epsilon 1e-3, gamma 1, beta 0, moving mean 0, moving
variance 1; the moving variance is updated with the biased batch variance.
"""

from __future__ import annotations

import math

import numpy as np

from pod.workloads.checks import check_number
from pod.workloads.layers import Layer, vector_op


class BatchNormalization(Layer):
    """y = gamma * (x - mean) / sqrt(var + eps) + beta over the last axis.

    Statistics are taken over every axis but the last: (B, C) inputs reduce
    over B, (B, H, W, C) over B, H and W.

    Args:
        momentum: running average factor in [0, 1):
            moving = momentum * moving + (1 - momentum) * batch.
        epsilon: added to the variance (> 0).
        name: layer name.

    Raises:
        ValueError: momentum or epsilon out of range.
    """

    kind = "batch_normalization"
    stateful = True

    def __init__(self, momentum: float = 0.99, epsilon: float = 1e-3, name: str | None = None):
        super().__init__(name)
        self.momentum = check_number(momentum, "BatchNormalization momentum", low=0.0, high=1.0,
                                     high_open=True)
        self.epsilon = check_number(epsilon, "BatchNormalization epsilon", low=0.0, low_open=True)

    def _channels(self, input_shape) -> int:
        if len(input_shape) < 1:
            raise ValueError(f"{self.name}: BatchNormalization needs at least (features,) inputs")
        return int(input_shape[-1])

    def param_shapes(self, input_shape):
        c = self._channels(input_shape)
        return {"gamma": (c,), "beta": (c,)}

    def init_params(self, rng, input_shape):
        c = self._channels(input_shape)
        return {"gamma": np.ones(c, np.float32), "beta": np.zeros(c, np.float32)}

    def state_shapes(self, input_shape):
        c = self._channels(input_shape)
        return {"moving_mean": (c,), "moving_variance": (c,)}

    def init_state(self, input_shape):
        c = self._channels(input_shape)
        return {"moving_mean": np.zeros(c, np.float32), "moving_variance": np.ones(c, np.float32)}

    def cache_elements(self, input_shape):
        return math.prod(input_shape)  # x_hat

    def forward(self, core, params, x, *, training=False, rng=None, state=None):
        """Returns (y, cache); cache = (x_hat, inv_std, batch mean, batch var, training)."""
        axes = tuple(range(x.ndim - 1))
        dt = x.dtype
        eps = np.asarray(self.epsilon, dt)
        gamma, beta = params["gamma"].astype(dt, copy=False), params["beta"].astype(dt, copy=False)
        c = (x.shape[-1],)
        if training:
            mean, var = vector_op(core, f"{self.name}/moments",
                                  lambda v: (v.mean(axis=axes), v.var(axis=axes)), x,
                                  out=[(c, dt), (c, dt)], ops_per_element=4.0)  # (C,), (C,) biased
        else:
            if state is None:
                raise ValueError(f"{self.name}: evaluation needs the running averages (state)")
            mean = state["moving_mean"].astype(dt, copy=False)
            var = state["moving_variance"].astype(dt, copy=False)
        inv = vector_op(core, f"{self.name}/rsqrt", lambda v: 1.0 / np.sqrt(v + eps), var,
                        out=(c, dt), transcendental=True)                 # (C,)
        x_hat = vector_op(core, f"{self.name}/normalize", lambda v: (v - mean) * inv, x,
                          out=(x.shape, dt), ops_per_element=2.0)         # like x
        y = vector_op(core, f"{self.name}/scale", lambda v: v * gamma + beta, x_hat,
                      out=(x.shape, dt), ops_per_element=2.0)
        return y, (x_hat, inv, mean, var, bool(training))

    def update_state(self, core, state, cache):
        """moving = momentum * moving + (1 - momentum) * batch statistic (float32)."""
        _, _, mean, var, training = cache
        if not training:
            return state
        m = np.float32(self.momentum)
        c = np.float32(1.0 - self.momentum)
        return {
            "moving_mean": core.vector(f"{self.name}/moving_mean",
                                       lambda s, b: m * s + c * b.astype(np.float32),
                                       state["moving_mean"], mean, ops_per_element=3.0),
            "moving_variance": core.vector(f"{self.name}/moving_variance",
                                           lambda s, b: m * s + c * b.astype(np.float32),
                                           state["moving_variance"], var, ops_per_element=3.0),
        }

    def backward(self, core, params, cache, dy, *, need_dx=True):
        x_hat, inv, _, _, training = cache
        axes = tuple(range(dy.ndim - 1))
        gamma = params["gamma"].astype(dy.dtype, copy=False)
        c = (dy.shape[-1],)
        dgamma, dbeta = vector_op(core, f"{self.name}/dgamma_dbeta",
                                  lambda d, xh: ((d * xh).sum(axis=axes), d.sum(axis=axes)),
                                  dy, x_hat, out=[(c, dy.dtype), (c, dy.dtype)],
                                  ops_per_element=3.0)                   # (C,), (C,)
        dx = None
        if need_dx:
            if training:
                n = np.asarray(math.prod(dy.shape[:-1]), dy.dtype)       # examples per statistic
                # dx = inv / n * (n * dxh - sum(dxh) - x_hat * sum(dxh * x_hat)), dxh = dy * gamma
                dx = vector_op(
                    core, f"{self.name}/dx",
                    lambda d, xh: (inv / n) * (n * gamma * d - gamma * dbeta
                                               - xh * (gamma * dgamma)),
                    dy, x_hat, out=(dy.shape, dy.dtype), ops_per_element=6.0)
            else:
                dx = vector_op(core, f"{self.name}/dx", lambda d: d * (gamma * inv), dy,
                               out=(dy.shape, dy.dtype))
        return dx, {"gamma": dgamma, "beta": dbeta}
