"""ResNet (He et al. 2016, "Deep Residual Learning for Image Recognition"), v1.5.

Per image (H, W, C) -> logits (num_classes,):

    stem:    conv 7x7/2 (width) + BN + ReLU + max-pool 3x3/2      ("imagenet")
             or conv 3x3/1 (width) + BN + ReLU                    ("small", for 8x8 / 32x32)
    stages:  per stage i (filters width * 2^i; stride 1 for the first stage, 2 after)
             ``blocks[i]`` residual blocks; the first of a stage has a projection
             shortcut (conv 1x1 with the stage's stride + BN) when the shape changes
    head:    global average pool + Dense(num_classes) (softmax fused into the loss)

A basic block (ResNet-18 / 34) is conv 3x3/s + BN + ReLU + conv 3x3 + BN; a
bottleneck block (ResNet-50 / 101 / 152) is conv 1x1 + BN + ReLU + conv 3x3/s
+ BN + ReLU + conv 1x1 (4 x filters) + BN: the stride on the 3x3 conv is
"v1.5", the variant of torchvision, the TensorFlow official models and
MLPerf. Both end in ReLU(main + shortcut). Convolutions have no bias (BN
follows each); BN uses momentum 0.9 and epsilon 1e-5 (torchvision's).
Parameter counts equal torchvision's (ResNet-18 11,689,512; ResNet-50
25,557,032 at 1000 classes; tested).

Every conv is an im2col GEMM on the MXU (``layers.Conv2D``) whose patches are
formed on chip, as XLA's convolutions are (HBM traffic: the input, the
weights and the output once; ``im2col_in_hbm=False``); every BN, ReLU, pool
and residual add is a VPU op of its own (no fusion: each reads and writes
HBM, which a TPU's fused kernels avoid). A layer's simulated cost shows where
the MXU is poorly used: the stem's contraction of 7 x 7 x 3 = 147 fills two
128-deep folds to 57%, layers with 64 output channels fill half the array's
128 columns, and stride-2 layers shrink M, the streamed dimension.
"""

from __future__ import annotations

import math

import numpy as np

from pod.workloads.checks import check_int
from pod.workloads.layers import Conv2D, Dense, Layer, ReLU, same_padding, vector_op
from pod.workloads.model import Model
from pod.workloads.normalization import BatchNormalization

__all__ = ["RESNET_DEPTHS", "STEMS", "GlobalAveragePooling2D", "MaxPool2DSame", "ResidualBlock",
           "build_resnet"]

#: depth -> (bottleneck blocks?, blocks per stage), He et al. 2016, table 1.
RESNET_DEPTHS = {18: (False, (2, 2, 2, 2)), 34: (False, (3, 4, 6, 3)),
                 50: (True, (3, 4, 6, 3)), 101: (True, (3, 4, 23, 3)),
                 152: (True, (3, 8, 36, 3))}
STEMS = ("imagenet", "small")
BOTTLENECK_EXPANSION = 4  # a bottleneck block's output channels / its filters
BN_MOMENTUM, BN_EPSILON = 0.9, 1e-5  # torchvision's BatchNorm2d (momentum 0.1 there = 1 - 0.9)


def _params_of(params: dict, prefix: str) -> dict:
    """The entries "<prefix>/<local>" of a block's dict, keyed by <local>."""
    n = len(prefix) + 1
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix + "/")}


class MaxPool2DSame(Layer):
    """Max pooling over P x P windows with stride S and 'same' padding (TF/XLA
    convention, ``same_padding``; padded cells never win), windows may overlap:
    ResNet's 3x3 / 2 pool. (B, H, W, C) -> (B, ceil(H / S), ceil(W / S), C).

    Backward sends each window's gradient to its FIRST maximum in row-major
    window order, as XLA's select-and-scatter does; overlapping windows add.

    Raises:
        ValueError: pool_size or stride not a positive integer.
    """

    kind = "max_pooling2d"

    def __init__(self, pool_size: int = 3, stride: int = 2, name: str | None = None):
        super().__init__(name)
        self.pool_size = check_int(pool_size, "MaxPool2DSame pool_size")
        self.stride = check_int(stride, "MaxPool2DSame stride")

    def _geometry(self, input_shape):
        if len(input_shape) != 3:
            raise ValueError(f"{self.name}: MaxPool2DSame expects (H, W, C) inputs, "
                             f"got {tuple(input_shape)}")
        h, w, _ = (int(v) for v in input_shape)
        return (same_padding(h, self.pool_size, self.stride),
                same_padding(w, self.pool_size, self.stride))

    def output_shape(self, input_shape):
        (ho, _, _), (wo, _, _) = self._geometry(input_shape)
        return (ho, wo, int(input_shape[2]))

    def cache_elements(self, input_shape):
        return math.prod(input_shape) + math.prod(self.output_shape(input_shape))  # x and y

    def _windows(self, x):
        """The padded input and the P*P strided views (each (B, Ho, Wo, C)), row-major."""
        (ho, top, bottom), (wo, left, right) = self._geometry(x.shape[1:])
        b, h, w, c = x.shape
        xp = np.full((b, h + top + bottom, w + left + right, c), -np.inf, x.dtype)
        xp[:, top:top + h, left:left + w, :] = x
        s, p = self.stride, self.pool_size
        span_h, span_w = s * (ho - 1) + 1, s * (wo - 1) + 1
        return xp, [(i, j, xp[:, i:i + span_h:s, j:j + span_w:s, :])
                    for i in range(p) for j in range(p)]

    def _forward(self, x):
        _, parts = self._windows(x)
        y = parts[0][2].copy()                                            # (B, Ho, Wo, C)
        for _, _, part in parts[1:]:
            np.maximum(y, part, out=y)
        return y

    def _backward(self, x, y, dy):
        xp, parts = self._windows(x)
        (_, top, _), (_, left, _) = self._geometry(x.shape[1:])
        dxp = np.zeros(xp.shape, dy.dtype)                                # (B, Hp, Wp, C)
        taken = np.zeros(y.shape, bool)       # the window's maximum is already routed
        s = self.stride
        ho, wo = y.shape[1:3]
        for i, j, part in parts:
            first = (part == y) & ~taken
            taken |= first
            dxp[:, i:i + s * (ho - 1) + 1:s, j:j + s * (wo - 1) + 1:s, :] += dy * first
        h, w = x.shape[1:3]
        return dxp[:, top:top + h, left:left + w, :]

    def forward(self, core, params, x, *, training=False, rng=None):
        y = vector_op(core, f"{self.name}/fwd", self._forward, x,
                      out=((x.shape[0], *self.output_shape(x.shape[1:])), x.dtype))
        return y, (x, y)

    def backward(self, core, params, cache, dy, *, need_dx=True):
        x, y = cache
        dx = vector_op(core, f"{self.name}/bwd", self._backward, x, y, dy,
                       out=(x.shape, dy.dtype), ops_per_element=3.0)
        return dx, {}


class GlobalAveragePooling2D(Layer):
    """(B, H, W, C) -> (B, C): the mean over every position (Keras'
    GlobalAveragePooling2D); backward spreads dy / (H * W) over the positions."""

    kind = "global_average_pooling2d"

    def output_shape(self, input_shape):
        if len(input_shape) != 3:
            raise ValueError(f"{self.name}: GlobalAveragePooling2D expects (H, W, C) inputs, "
                             f"got {tuple(input_shape)}")
        return (int(input_shape[2]),)

    def forward(self, core, params, x, *, training=False, rng=None):
        self.output_shape(x.shape[1:])
        y = vector_op(core, f"{self.name}/fwd", lambda v: v.mean(axis=(1, 2)), x,
                      out=((x.shape[0], x.shape[3]), x.dtype))                   # (B, C)
        return y, x.shape

    def backward(self, core, params, cache, dy, *, need_dx=True):
        b, h, w, c = cache
        scale = np.asarray(1.0 / (h * w), dy.dtype)
        dx = vector_op(core, f"{self.name}/bwd",
                       lambda d: np.broadcast_to((d * scale)[:, None, None, :], cache).copy(), dy,
                       out=(tuple(cache), dy.dtype))
        return dx, {}


class ResidualBlock(Layer):
    """A ResNet block: y = ReLU(main(x) + shortcut(x)).

    main: basic (conv 3x3/s, BN, ReLU, conv 3x3, BN; ``filters`` out) or
    bottleneck (conv 1x1, BN, ReLU, conv 3x3/s, BN, ReLU, conv 1x1, BN;
    4 x ``filters`` out). shortcut: with ``projection``, conv 1x1/s + BN;
    else the identity (input channels must equal the output's, stride 1).

    Params and BN state are the sub-layers' under their keys (``conv1/kernel``,
    ``bn1/gamma``, ``bn1/moving_mean``, ``shortcut_conv/kernel``, ...); ops are
    recorded as "<name>/<key>/..." so a report can split the block.

    Args:
        filters: channels of the block's convs (positive int).
        bottleneck: bottleneck (True) or basic (False) block.
        stride: stride of the block (1 or more), on its 3x3 conv and shortcut.
        projection: a conv 1x1 + BN shortcut.
        name: layer name.

    Raises:
        ValueError: bad filters / stride, or an identity shortcut where the shape changes.
    """

    kind = "residual_block"
    stateful = True

    def __init__(self, filters: int, *, bottleneck: bool, stride: int = 1, projection: bool = False,
                 name: str | None = None):
        super().__init__(name)
        filters = check_int(filters, "ResidualBlock filters")
        self.stride = check_int(stride, "ResidualBlock stride")
        self.bottleneck, self.projection = bool(bottleneck), bool(projection)
        self.out_channels = filters * (BOTTLENECK_EXPANSION if bottleneck else 1)
        n = self.name

        def conv(key, f, k, s=1):
            return key, Conv2D(f, k, stride=s, padding="same", use_bias=False, im2col_in_hbm=False,
                               name=f"{n}/{key}")

        def bn(key):
            return key, BatchNormalization(BN_MOMENTUM, BN_EPSILON, name=f"{n}/{key}")

        if bottleneck:
            main = [conv("conv1", filters, 1), bn("bn1"), ("relu1", ReLU(f"{n}/relu1")),
                    conv("conv2", filters, 3, self.stride), bn("bn2"),
                    ("relu2", ReLU(f"{n}/relu2")),
                    conv("conv3", self.out_channels, 1), bn("bn3")]
        else:
            main = [conv("conv1", filters, 3, self.stride), bn("bn1"),
                    ("relu1", ReLU(f"{n}/relu1")),
                    conv("conv2", filters, 3), bn("bn2")]
        self.main = tuple(main)
        self.shortcut = ((conv("shortcut_conv", self.out_channels, 1, self.stride),
                          bn("shortcut_bn")) if projection else ())
        self.relu_out = ReLU(f"{n}/relu_out")
        self.parts = dict(self.main + self.shortcut)
        self.matmul_params = tuple(f"{key}/kernel" for key, layer in self.parts.items()
                                   if isinstance(layer, Conv2D))

    def _shapes(self, input_shape) -> dict[str, tuple[int, ...]]:
        """Each part's input shape (per example), and the block's output under "out"."""
        if len(input_shape) != 3:
            raise ValueError(f"{self.name}: a residual block expects (H, W, C) inputs, "
                             f"got {tuple(input_shape)}")
        shape = tuple(int(v) for v in input_shape)
        if not self.projection and (self.stride != 1 or shape[2] != self.out_channels):
            raise ValueError(f"{self.name}: an identity shortcut needs stride 1 and "
                             f"{self.out_channels} input channels, got stride {self.stride} and "
                             f"input {shape}; use projection=True")
        shapes, h = {}, shape
        for key, layer in self.main:
            shapes[key] = h
            h = tuple(layer.output_shape(h))
        shapes["out"] = h
        s = shape
        for key, layer in self.shortcut:
            shapes[key] = s
            s = tuple(layer.output_shape(s))
        return shapes

    def output_shape(self, input_shape):
        return self._shapes(input_shape)["out"]

    def param_shapes(self, input_shape):
        shapes = self._shapes(input_shape)
        return {f"{key}/{k}": v for key, layer in self.parts.items()
                for k, v in layer.param_shapes(shapes[key]).items()}

    def init_params(self, rng, input_shape):
        shapes = self._shapes(input_shape)
        return {f"{key}/{k}": v for key, layer in self.parts.items()
                for k, v in layer.init_params(rng, shapes[key]).items()}

    def state_shapes(self, input_shape):
        shapes = self._shapes(input_shape)
        return {f"{key}/{k}": v for key, layer in self.parts.items()
                for k, v in layer.state_shapes(shapes[key]).items()}

    def init_state(self, input_shape):
        shapes = self._shapes(input_shape)
        return {f"{key}/{k}": v for key, layer in self.parts.items()
                for k, v in layer.init_state(shapes[key]).items()}

    def forward_flops(self, input_shape):
        shapes = self._shapes(input_shape)
        return sum(layer.forward_flops(shapes[key]) for key, layer in self.parts.items())

    def cache_elements(self, input_shape):
        """The parts' caches plus the output ReLU's (its output)."""
        shapes = self._shapes(input_shape)
        return (sum(layer.cache_elements(shapes[key]) for key, layer in self.parts.items())
                + math.prod(shapes["out"]))

    def _run(self, core, params, x, parts, training, state):
        caches = {}
        for key, layer in parts:
            p = _params_of(params, key)
            if layer.stateful:
                x, caches[key] = layer.forward(
                    core, p, x, training=training,
                    state=None if state is None else _params_of(state, key))
            else:
                x, caches[key] = layer.forward(core, p, x, training=training)
        return x, caches

    def forward(self, core, params, x, *, training=False, rng=None, state=None):
        """Returns (y, cache); ``state`` (the BN running averages, local keys) is
        needed in evaluation mode."""
        self._shapes(x.shape[1:])
        h, caches = self._run(core, params, x, self.main, training, state)       # (B, Ho, Wo, C')
        s, short = self._run(core, params, x, self.shortcut, training, state)
        caches.update(short)
        z = vector_op(core, f"{self.name}/residual_add", np.add, h, s, out=(h.shape, h.dtype))
        y, caches["relu_out"] = self.relu_out.forward(core, {}, z)
        return y, caches

    def update_state(self, core, state, cache):
        """Each BN's running averages moved towards its batch statistics."""
        out = {}
        for key, layer in self.parts.items():
            if layer.stateful:
                new = layer.update_state(core, _params_of(state, key), cache[key])
                out.update({f"{key}/{k}": v for k, v in new.items()})
        return out

    def _back(self, core, params, parts, caches, d, grads, need_dx):
        for i in range(len(parts) - 1, -1, -1):
            key, layer = parts[i]
            d, g = layer.backward(core, _params_of(params, key), caches[key], d,
                                  need_dx=need_dx or i > 0)
            grads.update({f"{key}/{k}": v for k, v in g.items()})
        return d

    def backward(self, core, params, cache, dy, *, need_dx=True):
        dz, _ = self.relu_out.backward(core, {}, cache["relu_out"], dy)
        grads: dict[str, np.ndarray] = {}
        dm = self._back(core, params, self.main, cache, dz, grads, need_dx)
        ds = self._back(core, params, self.shortcut, cache, dz, grads, need_dx)
        dx = (vector_op(core, f"{self.name}/residual_bwd", np.add, dm, ds, out=(dm.shape, dm.dtype))
              if need_dx else None)
        return dx, grads


def _positive_ints(field: str, value) -> tuple[int, ...]:
    if isinstance(value, (int, str)) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ValueError(f"resnet: option {field} must be a list of positive integers, "
                         f"got {value!r}")
    return tuple(value)


def _stem(stem: str, width: int) -> list[Layer]:
    bn = BatchNormalization(BN_MOMENTUM, BN_EPSILON, name="stem_bn")
    if stem == "imagenet":
        return [Conv2D(width, 7, stride=2, padding="same", use_bias=False, im2col_in_hbm=False,
                       name="stem_conv"), bn, ReLU("stem_relu"),
                MaxPool2DSame(3, 2, name="stem_pool")]
    return [Conv2D(width, 3, padding="same", use_bias=False, im2col_in_hbm=False, name="stem_conv"),
            bn, ReLU("stem_relu")]


def build_resnet(input_shape, num_classes: int, depth: int = 50, width: int = 64,
                 blocks=None, block: str | None = None, stem: str | None = None) -> Model:
    """A ResNet ``Model`` (see the module docstring).

    Args:
        input_shape: one image (H, W, C).
        num_classes: classes of the output layer.
        depth: 18, 34, 50, 101 or 152 (``RESNET_DEPTHS``): the blocks per stage
            and the block type, unless ``blocks`` / ``block`` say otherwise.
        width: filters of the stem and the first stage (64 in the paper); stage
            i has width * 2^i.
        blocks: blocks per stage, e.g. [1, 1] for a tiny two-stage ResNet.
        block: "basic" or "bottleneck" (default: the depth's).
        stem: "imagenet" (conv 7x7/2 + max-pool 3x3/2) or "small" (conv 3x3/1);
            default "imagenet" when H and W are at least 64, else "small".

    Returns:
        The model, named "resnet<depth>" for the standard stages, else "resnet".

    Raises:
        ValueError: a bad option (the message names it and what is allowed).
    """
    if len(input_shape) != 3:
        raise ValueError(f"resnet: input_shape must be (H, W, C) images, got {tuple(input_shape)}")
    if depth not in RESNET_DEPTHS:
        raise ValueError(f"resnet: option depth must be one of "
                         f"{', '.join(map(str, RESNET_DEPTHS))}, "
                         f"got {depth!r}")
    width = check_int(width, "resnet: option width")
    default_bottleneck, default_blocks = RESNET_DEPTHS[depth]
    stages = default_blocks if blocks is None else _positive_ints("blocks", blocks)
    if block not in (None, "basic", "bottleneck"):
        raise ValueError(f"resnet: option block must be basic or bottleneck, got {block!r}")
    bottleneck = default_bottleneck if block is None else block == "bottleneck"
    stem = stem or ("imagenet" if min(input_shape[:2]) >= 64 else "small")
    if stem not in STEMS:
        raise ValueError(f"resnet: option stem must be one of {', '.join(STEMS)}, got {stem!r}")
    layers = _stem(stem, width)
    channels = width
    for i, count in enumerate(stages):
        filters = width * 2 ** i
        for j in range(count):
            stride = 2 if (i > 0 and j == 0) else 1
            out = filters * (BOTTLENECK_EXPANSION if bottleneck else 1)
            layers.append(ResidualBlock(filters, bottleneck=bottleneck, stride=stride,
                                        projection=stride != 1 or channels != out,
                                        name=f"stage{i + 1}_block{j + 1}"))
            channels = out
    layers += [GlobalAveragePooling2D("avg_pool"), Dense(num_classes, "fc")]
    standard = blocks is None and block is None and width == 64
    return Model(f"resnet{depth}" if standard else "resnet", layers, tuple(input_shape),
                 num_classes)
