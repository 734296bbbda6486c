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
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from chip import to_bf16
from pod.workloads.checks import check_int


def mxu_input(core, x: np.ndarray) -> np.ndarray:
    """Returns ``x`` as the MXU will see it: bf16-rounded (float32) when
    ``core.numerics``, else unchanged. Pass the result with ``*_rounded=True``.
    On a timing-only core (``core.execute`` False) a float32 ``x`` is returned
    as is: the products are not computed, and the costs depend on shapes only."""
    if not core.numerics or (not core.execute and x.dtype == np.float32):
        return x
    return to_bf16(x)


def timing_zeros(shape, dtype) -> np.ndarray:
    """Zeros of ``shape`` as a read-only broadcast view of one zero: what a
    timing-only core returns for work it only costs (no memory, no page faults;
    ``size`` and ``nbytes`` are those of a real array)."""
    key = (shape, dtype) if type(shape) is tuple else None
    out = _VIEWS.get(key) if key is not None else None
    if out is None:
        dtype = np.dtype(dtype)
        zero = _ZERO.get(dtype)
        if zero is None:
            zero = _ZERO[dtype] = np.zeros(1, dtype)
        shape = tuple(int(n) for n in shape)
        out = np.ndarray(shape, dtype, buffer=zero, strides=(0,) * len(shape))  # 0-stride view
        out.flags.writeable = False
        if key is not None:
            if len(_VIEWS) >= _MAX_VIEWS:
                _VIEWS.clear()
            _VIEWS[key] = out
    return out


_ZERO: dict = {}  # dtype -> one zero element, the buffer of every timing_zeros view
#: (shape, dtype) -> its view, read-only, so one serves every caller: making a view is
#: most of what a timing-only op costs beside its record
_VIEWS: dict = {}
_MAX_VIEWS = 4096


def vector_op(core, name: str, fn, *arrays, out, ops_per_element: float = 1.0,
              transcendental: bool = False, fused: str | None = None):
    """``core.vector(name, fn, *arrays, ...)``, but on a timing-only core
    (``core.execute`` False) ``fn`` is not run: the same record is made from
    the shapes (``core.account_vector`` with the elements and bytes
    ``core.vector`` would count: the largest size among inputs and outputs,
    the inputs' and outputs' bytes) and zeros are returned: read-only
    broadcast views of one zero, which cost no memory (timing-only work
    never writes into them).

    Args:
        core: the TensorCore.
        name, fn, arrays, ops_per_element, transcendental, fused: as ``core.vector``
            (``fused``: the matmul this elementwise work is fused into, "previous"
            or "next"; None: an op of its own).
        out: what ``fn`` returns: (shape, dtype), or a list of them for a
            tuple result. Must be exact (a test runs every layer both ways and
            compares the records).

    Returns:
        fn(*arrays), or zeros of the ``out`` shapes and dtypes.
    """
    if core.execute:
        return core.vector(name, fn, *arrays, ops_per_element=ops_per_element,
                           transcendental=transcendental, fused=fused)
    several = isinstance(out, list)
    specs = out if several else (out,)
    results = tuple(timing_zeros(shape, dtype) for shape, dtype in specs)
    sizes = [np.asarray(a).size for a in arrays] + [r.size for r in results]
    nbytes = sum(np.asarray(a).nbytes for a in arrays) + sum(r.nbytes for r in results)
    core.account_vector(name, max(sizes), nbytes, ops_per_element=ops_per_element,
                        transcendental=transcendental, fused=fused)
    return results if several else results[0]


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
    # Tensor parallelism (pod.programs.transformer): local param name -> the axis split
    # over the mesh's tensor devices (1: columns, 0: rows); params not named are
    # replicated. Read-only.
    tensor_split: Mapping[str, int] = MappingProxyType({})
    # local param names replicated over tensor whose gradient on one tensor device covers
    # only its slice of the heads (a qk norm's scale, shared by the heads): the program
    # sums it over tensor
    tensor_partial: tuple[str, ...] = ()
    backward_reads_params = True  # False: FSDP need not gather the params before backward
    # Every layer defines forward(core, params, x, *, training=False, rng=None, ...) ->
    # (outputs, the cache backward reads) and backward(core, params, cache, dy, *,
    # need_dx=True, ...) -> (dx or None, {local name: gradient}); "...": options of its
    # own (a BatchNorm's state, a block's tensor hooks), so declared here, not defined
    forward: Callable[..., tuple[Any, Any]]
    backward: Callable[..., tuple[Any, Any]]

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


def _add_in_place(y: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.add(y, b, out=y)


def _bias_add(core, name: str, y: np.ndarray, b: np.ndarray) -> np.ndarray:
    # y is the product just computed: add into it (the same values as y + b, one
    # allocation and pass fewer) unless it is a timing-only zero view (read-only) or
    # the sum would widen its dtype
    add = (_add_in_place if y.flags.writeable and np.result_type(y, b) == y.dtype
           else np.add)
    return core.vector(f"{name}/bias_add", add, y, b)


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

    Kernel (KH, KW, C_in, C_out), bias (C_out,) unless ``use_bias=False``
    (a conv followed by BatchNorm, as in ResNet, has none). Padding "same"
    (TF/XLA convention, see ``same_padding``) or "valid".

    ``im2col_in_hbm`` says how the HBM traffic is costed. True (the default,
    the seed CNN's accounting): the patch matrix (B*Ho*Wo, KH*KW*C) is read
    from HBM by each GEMM and the input gradient is summed from its columns
    by a separate col2im pass on the VPU. False: as XLA's convolution emitter
    does on a TPU, the patches are formed on chip, so the forward and the
    weight-gradient GEMMs read the input (B, H, W, C) once, and the input
    gradient is a transposed convolution on the MXU that writes (B, H, W, C)
    with no separate pass (ResNet's convs). MXU cycles are the same either way.

    On a timing-only core (``core.execute`` False) the im2col / col2im
    buffers are not built: the same ops are recorded from their shapes
    (``account_matmul`` / ``account_vector``, the costs ``matmul`` and
    ``vector`` would record) and zeros of the right shape are returned.
    """

    kind = "conv2d"
    matmul_params = ("kernel",)

    def __init__(self, filters: int, kernel_size: int | tuple[int, int] = 2, *,
                 stride: int = 1, padding: str = "same", use_bias: bool = True,
                 im2col_in_hbm: bool = True, name: str | None = None):
        super().__init__(name)
        if not isinstance(im2col_in_hbm, bool):
            raise ValueError(f"Conv2D im2col_in_hbm must be true or false, got {im2col_in_hbm!r}")
        self.im2col_in_hbm = im2col_in_hbm
        if not isinstance(use_bias, bool):
            raise ValueError(f"Conv2D use_bias must be true or false, got {use_bias!r}")
        self.use_bias = use_bias
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
            raise ValueError(f"{self.name}: Conv2D expects (H, W, C) inputs, "
                             f"got {tuple(input_shape)}")
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
        shapes = {"kernel": (kh, kw, c, self.filters)}
        if self.use_bias:
            shapes["bias"] = (self.filters,)
        return shapes

    def init_params(self, rng, input_shape):
        shape = self.param_shapes(input_shape)["kernel"]
        kh, kw, c, f = shape
        params = {"kernel": glorot_uniform(rng, shape, kh * kw * c, kh * kw * f)}
        if self.use_bias:
            params["bias"] = np.zeros(f, np.float32)
        return params

    def output_shape(self, input_shape):
        _, _, _, ho, wo, _, _ = self._geometry(input_shape)
        return (ho, wo, self.filters)

    def forward_flops(self, input_shape):
        _, _, c, ho, wo, _, _ = self._geometry(input_shape)
        kh, kw = self.kernel_size
        return 2 * ho * wo * kh * kw * c * self.filters

    def cache_elements(self, input_shape):
        return math.prod(input_shape)  # the layer input (the device redoes im2col in backward)

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

    def _gemm(self, core, cols_shape, lhs, rhs, name, out_shape, dtype, **hbm):
        """One im2col GEMM, or on a timing-only core its cost alone (``lhs`` / ``rhs``
        are callables so the operands are built only when the product runs; ``hbm``:
        ``a_elements`` / ``out_elements`` when the patches stay on chip)."""
        hbm = {} if self.im2col_in_hbm else hbm
        if core.execute:
            return core.matmul(lhs(), rhs(), name=name, a_rounded=True, b_rounded=True, **hbm)
        core.account_matmul(*cols_shape, name=name, **hbm)
        return timing_zeros(out_shape, dtype)

    def forward(self, core, params, x, *, training=False, rng=None):
        b = x.shape[0]
        _, _, c, ho, wo, _, _ = self._geometry(x.shape[1:])
        kh, kw = self.kernel_size
        m, k = b * ho * wo, kh * kw * c
        xr = mxu_input(core, x)                                           # (B, H, W, C)
        w2d = params["kernel"].reshape(-1, self.filters)                  # (KH*KW*C, F)
        cols = self._im2col(xr) if core.execute else None                 # (B*Ho*Wo, K)
        y = self._gemm(core, (m, k, self.filters), lambda: cols, lambda: w2d,
                       f"{self.name}/fwd", (m, self.filters),
                       self._out_dtype(core, xr, w2d), a_elements=xr.size)  # (B*Ho*Wo, F)
        if self.use_bias:
            y = _bias_add(core, self.name, y, params["bias"])
        # the weight gradient reads the same columns: kept for it where the accounting
        # keeps them in HBM anyway (im2col_in_hbm; else rebuilt from the input, which
        # costs no host memory for a 7x7 conv's 49-fold columns)
        return y.reshape(b, ho, wo, self.filters), (xr, cols if self.im2col_in_hbm else None)

    @staticmethod
    def _out_dtype(core, a, b):
        return np.float32 if core.emulates_numerics else np.result_type(a, b)

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xr, cols = cache                                                  # (B, H, W, C)
        if cols is None and core.execute:
            cols = self._im2col(xr)                                       # (B*Ho*Wo, K)
        dy2d = dy.reshape(-1, self.filters)                               # (B*Ho*Wo, F)
        dyr = mxu_input(core, dy2d)
        m = dy2d.shape[0]
        k = math.prod(self.kernel_size) * xr.shape[3]
        w2d = params["kernel"].reshape(-1, self.filters)                  # (KH*KW*C, F)
        dw = self._gemm(core, (k, m, self.filters), lambda: cols.T, lambda: dyr,
                        f"{self.name}/dW", (k, self.filters),
                        self._out_dtype(core, xr, dyr), a_elements=xr.size)  # (KH*KW*C, F)
        grads = {"kernel": dw.reshape(params["kernel"].shape)}
        if self.use_bias:
            grads["bias"] = _bias_grad(core, self.name, dy2d)             # (F,)
        dx = None
        if need_dx:
            dtype = self._out_dtype(core, dyr, w2d)
            dcols = self._gemm(core, (m, self.filters, k), lambda: dyr, lambda: w2d.T,
                               f"{self.name}/dx", (m, k), dtype,
                               out_elements=xr.size)                      # (B*Ho*Wo, KH*KW*C)
            if not self.im2col_in_hbm:  # summed on chip by the transposed convolution
                dx = (self._col2im(dcols, xr.shape) if core.execute
                      else timing_zeros(xr.shape, dtype))                 # (B, H, W, C)
            elif core.execute:
                dx = core.vector(f"{self.name}/col2im",
                                 lambda d: self._col2im(d, xr.shape), dcols)  # (B, H, W, C)
            else:  # the cost of the col2im above: max(elements), bytes in and out
                dx = timing_zeros(xr.shape, dtype)
                core.account_vector(f"{self.name}/col2im", max(dcols.size, dx.size),
                                    dcols.nbytes + dx.nbytes)
        return dx, grads


class ReLU(Layer):
    """y = max(x, 0); the gradient passes where the output is positive."""

    kind = "relu"

    def cache_elements(self, input_shape):
        return math.prod(input_shape)

    def forward(self, core, params, x, *, training=False, rng=None):
        y = vector_op(core, f"{self.name}/fwd", lambda v: np.maximum(v, 0), x,
                      out=(x.shape, x.dtype))
        return y, y

    def backward(self, core, params, cache, dy, *, need_dx=True):
        y = cache
        dx = vector_op(core, f"{self.name}/bwd", _relu_grad, dy, y, out=(dy.shape, dy.dtype))
        return dx, {}


def _relu_grad(dy: np.ndarray, y: np.ndarray) -> np.ndarray:
    """dy * (y > 0): the mask made in dy's dtype and multiplied in place (the same
    products, dy * 1 or dy * 0, as numpy's bool-to-float multiply, in one temporary)."""
    mask = np.greater(y, 0).astype(np.result_type(dy, np.bool_))
    return np.multiply(mask, dy, out=mask)


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
            raise ValueError(f"{self.name}: MaxPool2D expects (H, W, C) inputs, "
                             f"got {tuple(input_shape)}")
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
        ho, wo = y.shape[1:3]
        whole = x.shape[1] == ho * p and x.shape[2] == wo * p  # every element in a window
        dx = (np.empty if whole else np.zeros)(x.shape, dy.dtype)              # (B, H, W, C)
        taken = None                         # window's maximum already routed
        parts = self._slices(x)
        for k, part in enumerate(parts):
            i, j = divmod(k, p)
            if k == len(parts) - 1:                                       # the only one left
                first = np.ones(y.shape, bool) if taken is None else ~taken
            else:
                first = part == y
                if taken is None:
                    taken = first
                else:
                    first &= ~taken
                    taken |= first
            np.multiply(dy, first, out=dx[:, i:ho * p:p, j:wo * p:p, :])  # dy where first, 0
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
        keep = (rng.random(shape, dtype=np.float32) >= self.rate).astype(dtype)
        keep *= np.asarray(1.0 / (1.0 - self.rate), dtype)
        return keep

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
            raise ValueError(f"{self.name}: input {tuple(input_shape)} is smaller than the "
                             f"pool {p}")
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
