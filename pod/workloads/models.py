"""Models: a sequence of layers, stateless, parameters passed in.

One ``Model`` object serves every replica: parameters are a flat ordered dict
``{"conv1/kernel": ..., "conv1/bias": ..., ...}`` of float32 arrays, created
by ``init_params(seed)`` and passed to every call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from chip import to_bf16
from pod.workloads.layers import Conv2D, Dense, Dropout, Flatten, Layer, MaxPool2D, ReLU
from pod.workloads.losses import softmax_cross_entropy

MODEL_NAMES = ("cnn", "mlp")

FLOAT32_BYTES = 4


class Model:
    """A feed-forward stack of layers with a softmax cross-entropy loss.

    Args:
        name: model name ("cnn", "mlp", or anything for a custom stack).
        layers: layers in order; their ``name`` attributes must be unique and
            prefix the parameter keys ("dense1/kernel").
        input_shape: one example's shape, e.g. (8, 8, 1).
        num_classes: number of logits.

    Raises:
        ValueError: duplicate layer names, or shapes that do not chain, or a
            last layer whose output is not (num_classes,).
    """

    def __init__(self, name: str, layers: Sequence[Layer], input_shape: tuple[int, ...],
                 num_classes: int):
        self.name = name
        self.layers = tuple(layers)
        self.input_shape = tuple(int(v) for v in input_shape)
        self.num_classes = int(num_classes)
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")
        # per layer input shapes (without batch), and the final output shape
        self._shapes = [self.input_shape]
        for layer in self.layers:
            self._shapes.append(tuple(layer.output_shape(self._shapes[-1])))
        if self._shapes[-1] != (self.num_classes,):
            raise ValueError(f"{name}: the last layer outputs {self._shapes[-1]}, "
                             f"expected ({self.num_classes},)")
        self.param_shapes = {f"{layer.name}/{k}": shape
                             for layer, in_shape in zip(self.layers, self._shapes)
                             for k, shape in layer.param_shapes(in_shape).items()}
        self._layer_keys = [[(f"{layer.name}/{k}", k) for k in layer.param_shapes(in_shape)]
                            for layer, in_shape in zip(self.layers, self._shapes)]
        self._matmul_keys = frozenset(f"{layer.name}/{k}" for layer in self.layers
                                      for k in layer.matmul_params)

    def __repr__(self) -> str:
        return (f"Model({self.name!r}, input_shape={self.input_shape}, "
                f"num_classes={self.num_classes}, layers={[layer.name for layer in self.layers]})")

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes.values())

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """Glorot-uniform kernels, zero biases, float32, from default_rng(seed)."""
        rng = np.random.default_rng(seed)
        params = {}
        for layer, in_shape in zip(self.layers, self._shapes):
            for k, v in layer.init_params(rng, in_shape).items():
                params[f"{layer.name}/{k}"] = v
        return params

    def _check_params(self, params) -> None:
        if params.keys() != self.param_shapes.keys():
            missing = sorted(self.param_shapes.keys() - params.keys())
            extra = sorted(params.keys() - self.param_shapes.keys())
            raise ValueError(f"{self.name}: params do not match the model "
                             f"(missing {missing}, unexpected {extra})")

    def prepare_params(self, core, params) -> list[dict[str, np.ndarray]]:
        """Per layer local param dicts; MXU weights rounded to bf16 once when
        ``core.numerics`` (every use then passes ``b_rounded=True``)."""
        self._check_params(params)
        return [{local: (to_bf16(params[key]) if core.numerics and key in self._matmul_keys
                         else params[key])
                 for key, local in keys}
                for keys in self._layer_keys]

    def _check_x(self, x) -> None:
        if tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"{self.name}: inputs must be (B, {', '.join(map(str, self.input_shape))}), "
                             f"got {x.shape}")

    def forward(self, core, local_params, x, *, training: bool, rng=None):
        """Runs the layers; returns logits (B, num_classes) and the caches."""
        caches = []
        for layer, p in zip(self.layers, local_params):
            x, cache = layer.forward(core, p, x, training=training, rng=rng)
            caches.append(cache)
        return x, caches

    def loss_and_grads(self, core, params, x, y, *, rng=None) -> tuple[float, dict[str, np.ndarray]]:
        """Training step on one shard: forward, loss, backward.

        Args:
            core: the ``chip.TensorCore`` that computes and costs the work.
            params: flat dict of float32 arrays (not modified).
            x: (B, *input_shape) inputs.
            y: (B,) integer labels.
            rng: numpy Generator for the dropout masks (needed if the model
                has active dropout).

        Returns:
            (loss, grads): mean loss over B as a float; grads with the keys,
            shapes and dtypes of ``params``.
        """
        self._check_x(x)
        local = self.prepare_params(core, params)
        logits, caches = self.forward(core, local, x, training=True, rng=rng)
        loss, dy = softmax_cross_entropy(core, logits, y)
        grads = {}
        # the input gradient of a layer is needed only if a layer before it has parameters
        first_trainable = next((i for i, keys in enumerate(self._layer_keys) if keys), 0)
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            dy, g = layer.backward(core, local[i], caches[i], dy, need_dx=i > first_trainable)
            for k, v in g.items():
                grads[f"{layer.name}/{k}"] = v
            if i <= first_trainable:
                break
        return loss, {k: grads[k].astype(params[k].dtype, copy=False) for k in params}

    def predict(self, core, params, x) -> np.ndarray:
        """Eval mode (no dropout): logits (B, num_classes)."""
        self._check_x(x)
        logits, _ = self.forward(core, self.prepare_params(core, params), x, training=False)
        return logits

    def evaluate(self, core, params, x, y) -> tuple[float, float]:
        """Eval mode: (mean loss, accuracy in [0, 1]) on (x, y)."""
        logits = self.predict(core, params, x)
        loss, _ = softmax_cross_entropy(core, logits, y)
        return loss, float(np.mean(logits.argmax(axis=1) == y))

    def activation_bytes(self, batch: int) -> int:
        """Bytes (float32) the layers keep from forward for backward in one
        training step of ``batch`` examples: layer inputs of conv / dense /
        pooling, ReLU outputs, dropout masks, plus the logits."""
        per_example = sum(layer.cache_elements(s) for layer, s in zip(self.layers, self._shapes))
        per_example += self.num_classes
        return int(batch) * per_example * FLOAT32_BYTES

    def forward_flops_per_example(self) -> int:
        """MXU FLOPs (2 per multiply-add) of one example's forward pass."""
        return sum(layer.forward_flops(s) for layer, s in zip(self.layers, self._shapes))

    def flops_per_example(self) -> int:
        """Training FLOPs per example: forward + backward = 3 x forward matmul
        FLOPs (backward = dX and dW, each the size of the forward product)."""
        return 3 * self.forward_flops_per_example()

    def summary_rows(self, batch: int | None = None) -> list[tuple[str, tuple, int, int]]:
        """Keras-like summary: (layer name, output shape with batch first,
        parameter count, forward MXU FLOPs per example) per layer."""
        return [(layer.name, (batch, *out), layer.param_count(s), layer.forward_flops(s))
                for layer, s, out in zip(self.layers, self._shapes, self._shapes[1:])]


def _dropout_rates(value, default: float, model: str) -> float:
    """dropout option -> rate: True -> default, False / 0 -> 0, float -> it."""
    if isinstance(value, bool):
        return default if value else 0.0
    if isinstance(value, (int, float)) and 0.0 <= float(value) < 1.0:
        return float(value)
    raise ValueError(f"{model}: option dropout must be true, false or a rate in [0, 1), got {value!r}")


def _cnn(input_shape, num_classes, dropout=True) -> list[Layer]:
    """The seed MNIST CNN, adapted to the input's size."""
    rates = (0.3, 0.3, 0.5) if dropout is True else (_dropout_rates(dropout, 0.0, "cnn"),) * 3
    if len(input_shape) != 3:
        raise ValueError(f"cnn: input_shape must be (H, W, C), got {tuple(input_shape)}")
    layers = [Conv2D(64, 2, padding="same", name="conv1"), ReLU("relu1"),
              MaxPool2D(2, name="pool1"), Dropout(rates[0], "dropout1"),
              Conv2D(32, 2, padding="same", name="conv2"), ReLU("relu2"),
              MaxPool2D(2, name="pool2"), Dropout(rates[1], "dropout2"),
              Flatten("flatten"),
              Dense(256, "dense1"), ReLU("relu3"), Dropout(rates[2], "dropout3"),
              Dense(num_classes, "dense2")]
    return [layer for layer in layers if not (isinstance(layer, Dropout) and layer.rate == 0.0)]


def _mlp(input_shape, num_classes, hidden=(128, 64), dropout=False) -> list[Layer]:
    """Flatten, then Dense + ReLU (+ Dropout) per hidden width, then Dense."""
    rate = _dropout_rates(dropout, 0.2, "mlp")
    if isinstance(hidden, (int, str)) or not all(isinstance(h, int) and h > 0 for h in hidden):
        raise ValueError(f"mlp: option hidden must be a list of positive integers, got {hidden!r}")
    layers: list[Layer] = [Flatten("flatten")]
    for i, width in enumerate(hidden, start=1):
        layers += [Dense(width, f"dense{i}"), ReLU(f"relu{i}")]
        if rate > 0:
            layers.append(Dropout(rate, f"dropout{i}"))
    layers.append(Dense(num_classes, f"dense{len(hidden) + 1}"))
    return layers


_BUILDERS = {"cnn": (_cnn, ("dropout",)), "mlp": (_mlp, ("hidden", "dropout"))}


def build_model(name: str, input_shape: Sequence[int], num_classes: int, **options) -> Model:
    """Builds a model by name.

    Args:
        name: one of ``MODEL_NAMES``: "cnn" (option ``dropout``: true (the
            seed rates 0.3, 0.3, 0.5, default), false / 0 (none) or a rate
            for every dropout layer) or "mlp" (options ``hidden``, default
            [128, 64], and ``dropout``: false (default), true (0.2) or a rate).
        input_shape: one example's shape, e.g. (8, 8, 1).
        num_classes: number of classes (>= 2).

    Raises:
        ValueError: unknown model name or option, or a bad value.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    builder, allowed = _BUILDERS[name]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} for model {name!r}; "
                         f"allowed: {', '.join(allowed)}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    shape = tuple(input_shape)
    if not shape or not all(isinstance(v, (int, np.integer)) and v > 0 for v in shape):
        raise ValueError(f"input_shape must be positive integers, got {input_shape!r}")
    return Model(name, builder(shape, num_classes, **options), shape, num_classes)
