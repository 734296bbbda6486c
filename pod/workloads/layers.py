"""Layers: forward and backward in numpy, heavy work through a TensorCore.

Every layer is a small stateless object. Its parameters live outside it, in a
dict keyed by local names ("kernel", "bias"), so one layer object serves every
replica. The protocol:

- ``init_params(rng, input_shape) -> dict`` (float32, Glorot-uniform kernels,
  zero biases); ``output_shape(input_shape)``; shapes exclude the batch axis.
- ``forward(core, params, x, *, training, rng) -> (y, cache)``.
- ``backward(core, params, cache, dy, *, need_dx=True) -> (dx, grads)``;
  ``grads`` has the keys of ``params``; ``dx`` is None when not needed.
- ``forward_flops(input_shape)``: MXU FLOPs of the forward pass per example.
- ``cache_elements(input_shape)``: elements kept for backward per example.

Matmuls (dense, conv as im2col GEMM) go through ``core.matmul``; elementwise
work (bias add, ReLU, pooling, dropout, col2im sums) through ``core.vector`` so
that it is costed. With ``core.numerics`` the MXU inputs are rounded to bf16:
the model rounds the weights once per step (``prepare_params``) and a layer
rounds its activation input once and reuses it for the forward product and the
weight gradient (hence ``a_rounded`` / ``b_rounded`` below). Without numerics
nothing is rounded and everything runs in the inputs' dtype (float64 for the
finite-difference tests).
"""

from __future__ import annotations

import math

import numpy as np

from chip import to_bf16
from pod.workloads.checks import check_int


def mxu_input(core, x: np.ndarray) -> np.ndarray:
    """Returns ``x`` as the MXU will see it: bf16-rounded (float32) when
    ``core.numerics``, else unchanged. Pass the result with ``*_rounded=True``."""
    return to_bf16(x) if core.numerics else x


def glorot_uniform(rng: np.random.Generator, shape: tuple[int, ...],
                   fan_in: int, fan_out: int) -> np.ndarray:
    """Glorot (Xavier) uniform init: U(-l, l), l = sqrt(6 / (fan_in + fan_out))."""
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


class Layer:
    """Base class: a parameter-free identity-shaped layer."""

    kind = "layer"
    matmul_params: tuple[str, ...] = ()  # local param names fed to the MXU
    stateful = False  # True: keeps non-trainable state (e.g. BatchNorm running averages)

    def __init__(self, name: str | None = None):
        self.name = name or self.kind

    def init_params(self, rng: np.random.Generator, input_shape) -> dict[str, np.ndarray]:
        return {}

    def output_shape(self, input_shape) -> tuple[int, ...]:
        return tuple(input_shape)

    def check_inputs(self, x: np.ndarray) -> None:
        """Raise ``DataMismatchError`` if ``x`` (B, *input_shape) cannot be this
        layer's input whatever its parameters (an embedding: ids outside its
        vocabulary); any values by default."""

    def forward_flops(self, input_shape) -> int:
        return 0

    def cache_elements(self, input_shape) -> int:
        return 0

    def param_count(self, input_shape) -> int:
        shapes = self.param_shapes(input_shape)
        return sum(math.prod(s) for s in shapes.values())

    def param_shapes(self, input_shape) -> dict[str, tuple[int, ...]]:
        return {}

    def state_shapes(self, input_shape) -> dict[str, tuple[int, ...]]:
        """Shapes of the non-trainable state (none unless ``stateful``)."""
        return {}

    def init_state(self, input_shape) -> dict[str, np.ndarray]:
        """Initial non-trainable state, float32 (none unless ``stateful``)."""
        return {}

    def update_state(self, core, state: dict[str, np.ndarray], cache) -> dict[str, np.ndarray]:
        """New state after a training-mode forward whose cache is ``cache``."""
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _bias_add(core, name: str, y: np.ndarray, b: np.ndarray) -> np.ndarray:
    return core.vector(f"{name}/bias_add", np.add, y, b)


def _bias_grad(core, name: str, dy2d: np.ndarray) -> np.ndarray:
    # (M, N) -> (N,): a reduction on the VPU
    return core.vector(f"{name}/bias_grad", lambda d: d.sum(axis=0), dy2d)


class Dense(Layer):
    """Fully connected: y = x @ W + b; x (B, D_in), W (D_in, D_out), b (D_out,).

    Also takes sequences x (B, T, D_in) -> (B, T, D_out), the same weights at
    every time step (Keras applies Dense to the last axis the same way), as
    one (B*T, D_in) x (D_in, D_out) GEMM.
    """

    kind = "dense"
    matmul_params = ("kernel",)

    def __init__(self, units: int, name: str | None = None):
        super().__init__(name)
        if int(units) != units or units < 1:
            raise ValueError(f"Dense units must be a positive integer, got {units!r}")
        self.units = int(units)

    def _check(self, input_shape) -> int:
        if len(input_shape) not in (1, 2):
            raise ValueError(f"{self.name}: Dense expects (features,) or (steps, features) inputs, "
                             f"got {tuple(input_shape)}; put a Flatten before it")
        return int(input_shape[-1])

    def param_shapes(self, input_shape):
        d_in = self._check(input_shape)
        return {"kernel": (d_in, self.units), "bias": (self.units,)}

    def init_params(self, rng, input_shape):
        d_in = self._check(input_shape)
        return {"kernel": glorot_uniform(rng, (d_in, self.units), d_in, self.units),
                "bias": np.zeros(self.units, np.float32)}

    def output_shape(self, input_shape):
        self._check(input_shape)
        return (*tuple(input_shape)[:-1], self.units)

    def forward_flops(self, input_shape):
        return 2 * math.prod(input_shape) * self.units

    def cache_elements(self, input_shape):
        self._check(input_shape)
        return math.prod(input_shape)

    def forward(self, core, params, x, *, training=False, rng=None):
        lead = x.shape[:-1]                                               # (B,) or (B, T)
        xr = mxu_input(core, x).reshape(-1, x.shape[-1])                  # (B[*T], D_in)
        y = core.matmul(xr, params["kernel"], name=f"{self.name}/fwd",
                        a_rounded=True, b_rounded=True)                   # (B[*T], D_out)
        y = _bias_add(core, self.name, y, params["bias"])
        return y.reshape(*lead, self.units), xr

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xr = cache                                                        # (B[*T], D_in)
        lead = dy.shape[:-1]
        dy = dy.reshape(-1, self.units)                                   # (B[*T], D_out)
        dyr = mxu_input(core, dy)
        dw = core.matmul(xr.T, dyr, name=f"{self.name}/dW",
                         a_rounded=True, b_rounded=True)                  # (D_in, D_out)
        db = _bias_grad(core, self.name, dy)                              # (D_out,)
        dx = None
        if need_dx:
            dx = core.matmul(dyr, params["kernel"].T, name=f"{self.name}/dx",
                             a_rounded=True, b_rounded=True)              # (B[*T], D_in)
            dx = dx.reshape(*lead, xr.shape[1])
        return dx, {"kernel": dw, "bias": db}


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int, int]:
    """TF/XLA 'same' padding along one axis.

    Returns (out_size, pad_before, pad_after) with out = ceil(size / stride),
    total = max((out - 1) * stride + kernel - size, 0), before = total // 2:
    the extra pixel goes after (a 2x2 stride-1 conv pads 0 before, 1 after).
    """
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return out, total // 2, total - total // 2


class Conv2D(Layer):
    """2-D convolution, NHWC, as im2col followed by one GEMM on the MXU.

    Kernel (KH, KW, C_in, C_out), bias (C_out,). Padding "same" (TF/XLA
    convention, see ``same_padding``) or "valid".
    """

    kind = "conv2d"
    matmul_params = ("kernel",)

    def __init__(self, filters: int, kernel_size: int | tuple[int, int] = 2, *,
                 stride: int = 1, padding: str = "same", name: str | None = None):
        super().__init__(name)
        if isinstance(kernel_size, int):
            kernel_size = (kernel_size, kernel_size)
        if int(filters) != filters or filters < 1:
            raise ValueError(f"Conv2D filters must be a positive integer, got {filters!r}")
        if len(kernel_size) != 2 or min(kernel_size) < 1:
            raise ValueError(f"Conv2D kernel_size must be positive, got {kernel_size!r}")
        if int(stride) != stride or stride < 1:
            raise ValueError(f"Conv2D stride must be a positive integer, got {stride!r}")
        if padding not in ("same", "valid"):
            raise ValueError(f"Conv2D padding must be 'same' or 'valid', got {padding!r}")
        self.filters = int(filters)
        self.kernel_size = (int(kernel_size[0]), int(kernel_size[1]))
        self.stride = int(stride)
        self.padding = padding

    def _geometry(self, input_shape):
        """Returns (H, W, C, Ho, Wo, (top, bottom), (left, right))."""
        if len(input_shape) != 3:
            raise ValueError(f"{self.name}: Conv2D expects (H, W, C) inputs, got {tuple(input_shape)}")
        h, w, c = (int(v) for v in input_shape)
        kh, kw = self.kernel_size
        s = self.stride
        if self.padding == "same":
            ho, top, bottom = same_padding(h, kh, s)
            wo, left, right = same_padding(w, kw, s)
        else:
            ho, wo, top, bottom, left, right = (h - kh) // s + 1, (w - kw) // s + 1, 0, 0, 0, 0
        if ho < 1 or wo < 1:
            raise ValueError(f"{self.name}: input {tuple(input_shape)} is smaller than the "
                             f"kernel {self.kernel_size} with padding {self.padding!r}")
        return h, w, c, ho, wo, (top, bottom), (left, right)

    def param_shapes(self, input_shape):
        c = self._geometry(input_shape)[2]
        kh, kw = self.kernel_size
        return {"kernel": (kh, kw, c, self.filters), "bias": (self.filters,)}

    def init_params(self, rng, input_shape):
        shape = self.param_shapes(input_shape)["kernel"]
        kh, kw, c, f = shape
        return {"kernel": glorot_uniform(rng, shape, kh * kw * c, kh * kw * f),
                "bias": np.zeros(f, np.float32)}

    def output_shape(self, input_shape):
        _, _, _, ho, wo, _, _ = self._geometry(input_shape)
        return (ho, wo, self.filters)

    def forward_flops(self, input_shape):
        _, _, c, ho, wo, _, _ = self._geometry(input_shape)
        kh, kw = self.kernel_size
        return 2 * ho * wo * kh * kw * c * self.filters

    def cache_elements(self, input_shape):
        return math.prod(input_shape)  # the layer input; im2col is redone in backward

    def _im2col(self, x):
        """(B, H, W, C) -> columns (B*Ho*Wo, KH*KW*C), ordered (kh, kw, c)."""
        b = x.shape[0]
        h, w, c, ho, wo, (top, bottom), (left, right) = self._geometry(x.shape[1:])
        kh, kw = self.kernel_size
        s = self.stride
        if top or bottom or left or right:
            xp = np.zeros((b, h + top + bottom, w + left + right, c), x.dtype)  # (B, Hp, Wp, C)
            xp[:, top:top + h, left:left + w, :] = x
        else:
            xp = x
        span_h, span_w = s * (ho - 1) + 1, s * (wo - 1) + 1
        cols = np.stack([xp[:, i:i + span_h:s, j:j + span_w:s, :]
                         for i in range(kh) for j in range(kw)], axis=3)  # (B, Ho, Wo, KH*KW, C)
        return cols.reshape(b * ho * wo, kh * kw * c)

    def _col2im(self, dcols, input_shape):
        """Adjoint of _im2col: (B*Ho*Wo, KH*KW*C) -> (B, H, W, C), overlaps summed."""
        b = input_shape[0]
        h, w, c, ho, wo, (top, bottom), (left, right) = self._geometry(input_shape[1:])
        kh, kw = self.kernel_size
        s = self.stride
        dcols = dcols.reshape(b, ho, wo, kh * kw, c)
        dxp = np.zeros((b, h + top + bottom, w + left + right, c), dcols.dtype)  # (B, Hp, Wp, C)
        span_h, span_w = s * (ho - 1) + 1, s * (wo - 1) + 1
        for i in range(kh):
            for j in range(kw):
                dxp[:, i:i + span_h:s, j:j + span_w:s, :] += dcols[:, :, :, i * kw + j, :]
        return dxp[:, top:top + h, left:left + w, :]

    def forward(self, core, params, x, *, training=False, rng=None):
        b = x.shape[0]
        _, _, _, ho, wo, _, _ = self._geometry(x.shape[1:])
        xr = mxu_input(core, x)                                           # (B, H, W, C)
        cols = self._im2col(xr)                                           # (B*Ho*Wo, KH*KW*C)
        w2d = params["kernel"].reshape(-1, self.filters)                  # (KH*KW*C, F)
        y = core.matmul(cols, w2d, name=f"{self.name}/fwd",
                        a_rounded=True, b_rounded=True)                   # (B*Ho*Wo, F)
        y = _bias_add(core, self.name, y, params["bias"])
        return y.reshape(b, ho, wo, self.filters), xr

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xr = cache                                                        # (B, H, W, C)
        dy2d = dy.reshape(-1, self.filters)                               # (B*Ho*Wo, F)
        dyr = mxu_input(core, dy2d)
        cols = self._im2col(xr)                                           # (B*Ho*Wo, KH*KW*C)
        dw = core.matmul(cols.T, dyr, name=f"{self.name}/dW",
                         a_rounded=True, b_rounded=True)                  # (KH*KW*C, F)
        db = _bias_grad(core, self.name, dy2d)                            # (F,)
        dx = None
        if need_dx:
            w2d = params["kernel"].reshape(-1, self.filters)
            dcols = core.matmul(dyr, w2d.T, name=f"{self.name}/dx",
                                a_rounded=True, b_rounded=True)           # (B*Ho*Wo, KH*KW*C)
            dx = core.vector(f"{self.name}/col2im",
                             lambda d: self._col2im(d, xr.shape), dcols)  # (B, H, W, C)
        return dx, {"kernel": dw.reshape(params["kernel"].shape), "bias": db}


class ReLU(Layer):
    """y = max(x, 0); the gradient passes where the output is positive."""

    kind = "relu"

    def cache_elements(self, input_shape):
        return math.prod(input_shape)

    def forward(self, core, params, x, *, training=False, rng=None):
        y = core.vector(f"{self.name}/fwd", lambda v: np.maximum(v, 0), x)
        return y, y

    def backward(self, core, params, cache, dy, *, need_dx=True):
        y = cache
        dx = core.vector(f"{self.name}/bwd", lambda d, out: d * (out > 0), dy, y)
        return dx, {}


class MaxPool2D(Layer):
    """Max pooling over non-overlapping P x P windows (stride P), 'valid'.

    Backward sends each window's gradient to its FIRST maximum in row-major
    window order, as XLA's select-and-scatter does; tied maxima (common on
    digits, whose pixels come in steps of 1/16) get nothing else.
    """

    kind = "max_pooling2d"

    def __init__(self, pool_size: int = 2, *, stride: int | None = None, name: str | None = None):
        super().__init__(name)
        stride = pool_size if stride is None else stride
        if int(pool_size) != pool_size or pool_size < 1:
            raise ValueError(f"MaxPool2D pool_size must be a positive integer, got {pool_size!r}")
        if stride != pool_size:
            raise ValueError(f"MaxPool2D supports stride == pool_size only, got stride {stride!r} "
                             f"with pool_size {pool_size!r}")
        self.pool_size = int(pool_size)

    def output_shape(self, input_shape):
        if len(input_shape) != 3:
            raise ValueError(f"{self.name}: MaxPool2D expects (H, W, C) inputs, got {tuple(input_shape)}")
        h, w, c = input_shape
        p = self.pool_size
        if h < p or w < p:
            raise ValueError(f"{self.name}: input {tuple(input_shape)} is smaller than the "
                             f"{p}x{p} pooling window")
        return (h // p, w // p, c)

    def cache_elements(self, input_shape):
        return math.prod(input_shape) + math.prod(self.output_shape(input_shape))  # x and y

    def _slices(self, x):
        """The P*P strided views x[:, i::P, j::P] (each (B, Ho, Wo, C)), in
        row-major window order, cropped to whole windows."""
        ho, wo, _ = self.output_shape(x.shape[1:])
        p = self.pool_size
        return [x[:, i:ho * p:p, j:wo * p:p, :] for i in range(p) for j in range(p)]

    def _forward(self, x):
        parts = self._slices(x)
        y = parts[0].copy()                                               # (B, Ho, Wo, C)
        for part in parts[1:]:
            np.maximum(y, part, out=y)
        return y

    def forward(self, core, params, x, *, training=False, rng=None):
        y = core.vector(f"{self.name}/fwd", self._forward, x)
        return y, (x, y)

    def _backward(self, x, y, dy):
        p = self.pool_size
        dx = np.zeros(x.shape, dy.dtype)                                  # (B, H, W, C)
        taken = np.zeros(y.shape, bool)      # window's maximum already routed
        parts = self._slices(x)
        for k, part in enumerate(parts):
            i, j = divmod(k, p)
            if k == len(parts) - 1:
                first = ~taken                                            # the only one left
            else:
                first = (part == y) & ~taken
                taken |= first
            ho, wo = y.shape[1:3]
            dx[:, i:ho * p:p, j:wo * p:p, :] = dy * first
        return dx

    def backward(self, core, params, cache, dy, *, need_dx=True):
        x, y = cache
        dx = core.vector(f"{self.name}/bwd", self._backward, x, y, dy, ops_per_element=3.0)
        return dx, {}


class Dropout(Layer):
    """Inverted dropout: in training, keep each element with probability
    1 - rate and scale it by 1 / (1 - rate); identity in eval mode."""

    kind = "dropout"

    def __init__(self, rate: float, name: str | None = None):
        super().__init__(name)
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(f"Dropout rate must be in [0, 1), got {rate!r}")
        self.rate = float(rate)

    def cache_elements(self, input_shape):
        return math.prod(input_shape) if self.rate > 0 else 0

    def mask(self, rng: np.random.Generator, shape, dtype) -> np.ndarray:
        """Scaled keep-mask: 0 or 1 / (1 - rate), drawn from ``rng``."""
        keep = rng.random(shape, dtype=np.float32) >= self.rate
        return keep.astype(dtype) * np.asarray(1.0 / (1.0 - self.rate), dtype)

    def forward(self, core, params, x, *, training=False, rng=None):
        if not training or self.rate == 0.0:
            return x, None
        if rng is None:
            raise ValueError(f"{self.name}: training with dropout needs an rng (numpy Generator)")
        m = self.mask(rng, x.shape, x.dtype)
        return core.vector(f"{self.name}/fwd", np.multiply, x, m), m

    def backward(self, core, params, cache, dy, *, need_dx=True):
        if cache is None:
            return dy, {}
        return core.vector(f"{self.name}/bwd", np.multiply, dy, cache), {}


class Flatten(Layer):
    """(B, d1, d2, ...) -> (B, d1 * d2 * ...); a free reshape."""

    kind = "flatten"

    def output_shape(self, input_shape):
        return (math.prod(input_shape),)

    def forward(self, core, params, x, *, training=False, rng=None):
        return x.reshape(x.shape[0], -1), x.shape

    def backward(self, core, params, cache, dy, *, need_dx=True):
        return dy.reshape(cache), {}


class AveragePooling2D(Layer):
    """Average pooling over non-overlapping P x P windows (stride P), 'valid'.

    (B, H, W, C) -> (B, H // P, W // P, C); a last row / column that does not
    fill a window is dropped (and gets zero gradient), as in Keras.
    """

    kind = "average_pooling2d"

    def __init__(self, pool_size: int = 2, name: str | None = None):
        super().__init__(name)
        self.pool_size = check_int(pool_size, "AveragePooling2D pool_size")

    def output_shape(self, input_shape):
        if len(input_shape) != 3:
            raise ValueError(f"{self.name}: AveragePooling2D expects (H, W, C) inputs, "
                             f"got {tuple(input_shape)}")
        h, w, c = input_shape
        p = self.pool_size
        if h < p or w < p:
            raise ValueError(f"{self.name}: input {tuple(input_shape)} is smaller than the pool {p}")
        return (h // p, w // p, c)

    def _forward(self, x):
        p = self.pool_size
        b, h, w, c = x.shape
        ho, wo = h // p, w // p
        windows = x[:, :ho * p, :wo * p, :].reshape(b, ho, p, wo, p, c)  # (B, Ho, P, Wo, P, C)
        return windows.mean(axis=(2, 4))                                  # (B, Ho, Wo, C)

    def _backward(self, x_shape, dy):
        p = self.pool_size
        b, h, w, c = x_shape
        ho, wo = dy.shape[1:3]
        dx = np.zeros(x_shape, dy.dtype)                                  # (B, H, W, C)
        share = dy * np.asarray(1.0 / (p * p), dy.dtype)                  # (B, Ho, Wo, C)
        dx[:, :ho * p, :wo * p, :] = np.repeat(np.repeat(share, p, axis=1), p, axis=2)
        return dx

    def forward(self, core, params, x, *, training=False, rng=None):
        self.output_shape(x.shape[1:])
        y = core.vector(f"{self.name}/fwd", self._forward, x)
        return y, x.shape

    def backward(self, core, params, cache, dy, *, need_dx=True):
        dx = core.vector(f"{self.name}/bwd", lambda d: self._backward(cache, d), dy)
        return dx, {}


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function 1 / (1 + exp(-x)), without overflow for large |x|."""
    e = np.exp(-np.abs(x))                                                # in (0, 1]
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


class Tanh(Layer):
    """y = tanh(x); dx = dy * (1 - y^2)."""

    kind = "tanh"

    def cache_elements(self, input_shape):
        return math.prod(input_shape)

    def forward(self, core, params, x, *, training=False, rng=None):
        y = core.vector(f"{self.name}/fwd", np.tanh, x, transcendental=True)
        return y, y

    def backward(self, core, params, cache, dy, *, need_dx=True):
        one = np.asarray(1.0, dy.dtype)
        dx = core.vector(f"{self.name}/bwd", lambda d, y: d * (one - y * y), dy, cache,
                         ops_per_element=3.0)
        return dx, {}


class Sigmoid(Layer):
    """y = 1 / (1 + exp(-x)); dx = dy * y * (1 - y)."""

    kind = "sigmoid"

    def cache_elements(self, input_shape):
        return math.prod(input_shape)

    def forward(self, core, params, x, *, training=False, rng=None):
        y = core.vector(f"{self.name}/fwd", sigmoid, x, ops_per_element=3.0, transcendental=True)
        return y, y

    def backward(self, core, params, cache, dy, *, need_dx=True):
        one = np.asarray(1.0, dy.dtype)
        dx = core.vector(f"{self.name}/bwd", lambda d, y: d * y * (one - y), dy, cache,
                         ops_per_element=3.0)
        return dx, {}


class Softmax(Layer):
    """Softmax over the last axis: y = exp(x - max) / sum(exp(x - max));
    dx = y * (dy - sum(dy * y)) (the Jacobian-vector product).

    The models end in logits and fuse the softmax into the loss
    (``softmax_cross_entropy``), which is more stable; this layer is for
    models that want probabilities as an output.
    """

    kind = "softmax"

    def cache_elements(self, input_shape):
        return math.prod(input_shape)

    @staticmethod
    def _softmax(x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def forward(self, core, params, x, *, training=False, rng=None):
        y = core.vector(f"{self.name}/fwd", self._softmax, x, ops_per_element=4.0,
                        transcendental=True)
        return y, y

    def backward(self, core, params, cache, dy, *, need_dx=True):
        dx = core.vector(f"{self.name}/bwd",
                         lambda d, y: y * (d - (d * y).sum(axis=-1, keepdims=True)),
                         dy, cache, ops_per_element=4.0)
        return dx, {}
