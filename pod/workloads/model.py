"""``Model``: a sequence of layers, stateless, parameters passed in.

One ``Model`` object serves every replica: parameters are a flat ordered dict
``{"conv1/kernel": ..., "conv1/bias": ..., ...}`` of float32 arrays, created
by ``init_params(seed)`` and passed to every call. The named models are built
in ``pod.workloads.models``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chip import to_bf16
from pod.workloads.checks import DataMismatchError
from pod.workloads.layers import Layer
from pod.workloads.losses import sigmoid_binary_cross_entropy, softmax_cross_entropy

__all__ = ["Model", "LOSSES", "FLOAT32_BYTES", "ACTIVATION_BYTES", "ActivationMemory",
           "activation_bytes_per_element"]

LOSSES = ("softmax_cross_entropy", "sigmoid_binary_cross_entropy")

FLOAT32_BYTES = 4

#: Bytes of an activation element per training precision: bf16 training keeps its
#: activations in bf16 (MaxText ``dtype: bfloat16``, training-steps.md), int8
#: training too (only the MXU inputs are quantised); fp32 training in float32.
ACTIVATION_BYTES = {"bf16": 2, "int8": 2, "fp32": 4}


def activation_bytes_per_element(precision: str) -> int:
    """Bytes of an activation element under ``precision`` (``ACTIVATION_BYTES``).

    Raises:
        ValueError: an unknown precision.
    """
    try:
        return ACTIVATION_BYTES[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {', '.join(ACTIVATION_BYTES)}, "
                         f"got {precision!r}") from None


@dataclass(frozen=True)
class ActivationMemory:
    """One device's activations in a training step, bytes.

    Attributes:
        device_bytes: what forward keeps in HBM for backward.
        host_bytes: what forward keeps in host memory (remat offload).
        transient_bytes: the largest working set of one layer while backward
            runs, beside what is kept (the recomputed activations of one layer,
            or the output layer's logits and their gradient); 0 when not modelled.
    """

    device_bytes: int
    host_bytes: int = 0
    transient_bytes: int = 0


class Model:
    """A feed-forward stack of layers ending in logits, with a fused loss.

    Args:
        name: model name ("cnn", "mlp", ... or anything for a custom stack).
        layers: layers in order; their ``name`` attributes must be unique and
            prefix the parameter and state keys ("dense1/kernel",
            "bn1/moving_mean").
        input_shape: one example's shape, e.g. (8, 8, 1), or (250,) token ids.
        num_classes: number of classes.
        loss: "softmax_cross_entropy" (the last layer outputs (num_classes,),
            or (T, num_classes) for a label per time step) or
            "sigmoid_binary_cross_entropy" (num_classes 2, last layer (1,)).

    Raises:
        ValueError: duplicate layer names, shapes that do not chain, or a
            last layer whose output does not fit the loss.
    """

    def __init__(self, name: str, layers: Sequence[Layer], input_shape: tuple[int, ...],
                 num_classes: int, loss: str = "softmax_cross_entropy"):
        self.name = name
        self.layers = tuple(layers)
        self.input_shape = tuple(int(v) for v in input_shape)
        self.num_classes = int(num_classes)
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        self.loss = loss
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")
        # per layer input shapes (without batch), and the final output shape: one more
        # than the layers, so zip(self.layers, self._shapes, strict=False) pairs each layer
        # with its input
        self._shapes = [self.input_shape]
        for layer in self.layers:
            self._shapes.append(tuple(layer.output_shape(self._shapes[-1])))
        out = self._shapes[-1]
        if loss == "softmax_cross_entropy" and (len(out) not in (1, 2)
                                                or out[-1] != self.num_classes):
            raise ValueError(f"{name}: the last layer outputs {out}, "
                             f"expected ({self.num_classes},) "
                             f"or (steps, {self.num_classes})")
        if loss == "sigmoid_binary_cross_entropy" and (out != (1,) or self.num_classes != 2):
            raise ValueError(f"{name}: binary cross-entropy needs 2 classes and a last layer "
                             f"output of (1,), got {self.num_classes} classes and {out}")
        self.output_shape = out
        self.param_shapes = {f"{layer.name}/{k}": shape
                             for layer, in_shape in zip(self.layers, self._shapes, strict=False)
                             for k, shape in layer.param_shapes(in_shape).items()}
        self.state_shapes = {f"{layer.name}/{k}": shape
                             for layer, in_shape in zip(self.layers, self._shapes, strict=False)
                             for k, shape in layer.state_shapes(in_shape).items()}
        self._layer_keys = [[(f"{layer.name}/{k}", k) for k in layer.param_shapes(in_shape)]
                            for layer, in_shape in zip(self.layers, self._shapes, strict=False)]
        self._state_keys = [[(f"{layer.name}/{k}", k) for k in layer.state_shapes(in_shape)]
                            for layer, in_shape in zip(self.layers, self._shapes, strict=False)]
        self._matmul_keys = frozenset(f"{layer.name}/{k}" for layer in self.layers
                                      for k in layer.matmul_params)

    def __repr__(self) -> str:
        return (f"Model({self.name!r}, input_shape={self.input_shape}, "
                f"num_classes={self.num_classes}, layers={[layer.name for layer in self.layers]})")

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes.values())

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype ``init_params`` stores parameters in: float32 (the transformer's
        ``weight_dtype`` may make it bf16)."""
        return np.dtype(np.float32)

    def gradient_buckets(self) -> tuple[tuple[str, int], ...]:
        """The layers with parameters in backward order, with their parameter counts:
        the order in which the backward pass finishes each layer's gradients (each
        layer's gradients are one bucket of the overlapped allreduce)."""
        out = []
        for layer, keys in zip(reversed(self.layers), reversed(self._layer_keys), strict=True):
            if keys:
                out.append((layer.name, sum(math.prod(self.param_shapes[k]) for k, _ in keys)))
        return tuple(out)

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """Glorot-uniform kernels, zero biases, float32, from default_rng(seed)."""
        rng = np.random.default_rng(seed)
        params = {}
        for layer, in_shape in zip(self.layers, self._shapes, strict=False):
            for k, v in layer.init_params(rng, in_shape).items():
                params[f"{layer.name}/{k}"] = v
        return params

    def init_state(self) -> dict[str, np.ndarray]:
        """Non-trainable state (BatchNorm running averages), float32; {} if none."""
        state = {}
        for layer, in_shape in zip(self.layers, self._shapes, strict=False):
            for k, v in layer.init_state(in_shape).items():
                state[f"{layer.name}/{k}"] = v
        return state

    def _check_params(self, params) -> None:
        if params.keys() != self.param_shapes.keys():
            missing = sorted(self.param_shapes.keys() - params.keys())
            extra = sorted(params.keys() - self.param_shapes.keys())
            raise ValueError(f"{self.name}: params do not match the model "
                             f"(missing {missing}, unexpected {extra})")

    def prepare_params(self, core, params) -> list[dict[str, np.ndarray]]:
        """Per layer local param dicts; MXU weights rounded to bf16 once when
        ``core.numerics`` (every use then passes ``b_rounded=True``), except on a
        timing-only core (``core.execute`` False), which computes no product."""
        self._check_params(params)
        rounding = core.numerics and core.execute
        return [{local: (to_bf16(params[key]) if rounding and key in self._matmul_keys
                         else params[key])
                 for key, local in keys}
                for keys in self._layer_keys]

    def _local_state(self, state) -> list[dict[str, np.ndarray]]:
        state = self.init_state() if state is None else state
        if state.keys() != self.state_shapes.keys():
            raise ValueError(f"{self.name}: state keys {sorted(state)} do not match the model's "
                             f"{sorted(self.state_shapes)}")
        return [{local: state[key] for key, local in keys} for keys in self._state_keys]

    def check_data(self, x: np.ndarray, y: np.ndarray) -> None:
        """Check a whole split against the model before any chip sees it.

        Args:
            x: (N, *input_shape) inputs.
            y: (N, *label_shape) labels: one class per example (N,) when the
                model predicts (num_classes,) or (1,); one per step (N, T)
                when it predicts (T, num_classes).

        Raises:
            DataMismatchError: the labels per example are not what the loss
                takes, or the first layer refuses the inputs.
            TokenIdError: token ids outside the first layer's vocabulary.
        """
        want = self.output_shape[:-1]
        got = tuple(y.shape[1:])
        if got != want:
            per = "one class per example" if not want else f"a class per step {want}"
            raise DataMismatchError(f"{self.name} predicts {per} (output "
                                    f"{self.output_shape}), but the labels are "
                                    f"{got or 'one class'} per example")
        self._check_x(x)
        if self.layers:
            self.layers[0].check_inputs(x)

    def _check_x(self, x) -> None:
        if tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"{self.name}: inputs must be "
                             f"(B, {', '.join(map(str, self.input_shape))}), "
                             f"got {x.shape}")

    def forward(self, core, local_params, x, *, training: bool, rng=None, local_state=None):
        """Runs the layers; returns the outputs (B, *output_shape) and the caches.

        ``local_state`` (per layer dicts) is needed by stateful layers in
        evaluation mode; in training mode they use batch statistics.
        """
        caches = []
        for i, (layer, p) in enumerate(zip(self.layers, local_params, strict=False)):
            if layer.stateful:
                x, cache = layer.forward(core, p, x, training=training, rng=rng,
                                         state=None if local_state is None else local_state[i])
            else:
                x, cache = layer.forward(core, p, x, training=training, rng=rng)
            caches.append(cache)
        return x, caches

    def layer_param_keys(self) -> tuple[tuple[tuple[str, str], ...], ...]:
        """Per layer, its parameters as (model key, layer-local name) pairs, in
        layer order (a shared parameter appears under every layer that uses it)."""
        return tuple(tuple(keys) for keys in self._layer_keys)

    def output_loss(self, core, out, y) -> tuple[float, np.ndarray]:
        """(mean loss over the predictions of ``out``, its gradient w.r.t. ``out``)."""
        return self._loss(core, out, y)

    def _loss(self, core, out, y) -> tuple[float, np.ndarray]:
        if self.loss == "sigmoid_binary_cross_entropy":
            return sigmoid_binary_cross_entropy(core, out, y)
        if out.ndim == 3:                                                 # (B, T, K), y (B, T)
            loss, d = softmax_cross_entropy(core, out.reshape(-1, out.shape[-1]), y.reshape(-1))
            return loss, d.reshape(out.shape)
        return softmax_cross_entropy(core, out, y)

    def loss_grads_and_state(self, core, params, x, y, *, state=None, rng=None
                             ) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Training step on one shard: forward, loss, backward, new model state.

        Args:
            core: the ``chip.TensorCore`` that computes and costs the work.
            params: flat dict of float32 arrays (not modified).
            x: (B, *input_shape) inputs (float, or integer token ids).
            y: (B,) integer labels, or (B, T) for a label per time step.
            state: the model state (``init_state()`` if None; not modified).
            rng: numpy Generator for the dropout masks (needed if the model
                has active dropout).

        Returns:
            (loss, grads, new_state): mean loss over the shard as a float;
            grads with the keys, shapes and dtypes of ``params``; the state
            after this step (BatchNorm running averages moved towards this
            shard's statistics), float32.
        """
        self._check_x(x)
        local = self.prepare_params(core, params)
        local_state = self._local_state(state)
        out, caches = self.forward(core, local, x, training=True, rng=rng)
        loss, dy = self._loss(core, out, y)
        new_state = {}
        for i, layer in enumerate(self.layers):
            if layer.stateful:
                for k, v in layer.update_state(core, local_state[i], caches[i]).items():
                    new_state[f"{layer.name}/{k}"] = v
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
        grads = {k: grads[k].astype(params[k].dtype, copy=False) for k in params}
        return loss, grads, {k: new_state[k] for k in self.state_shapes}

    def loss_and_grads(self, core, params, x, y, *, rng=None, state=None
                       ) -> tuple[float, dict[str, np.ndarray]]:
        """``loss_grads_and_state`` without the new state: (loss, grads)."""
        loss, grads, _ = self.loss_grads_and_state(core, params, x, y, state=state, rng=rng)
        return loss, grads

    def predict(self, core, params, x, *, state=None) -> np.ndarray:
        """Eval mode (no dropout, BatchNorm on the running averages): the
        outputs (B, *output_shape), logits."""
        self._check_x(x)
        out, _ = self.forward(core, self.prepare_params(core, params), x, training=False,
                              local_state=self._local_state(state))
        return out

    def evaluate_sums(self, core, params, x, y, *, state=None) -> tuple[float, int, int]:
        """Eval mode: (sum of the losses, correct predictions, predictions).

        A prediction is one example, or one time step for per-step labels.
        Sums (not means) so that batches of a test set can be added up.
        """
        out = self.predict(core, params, x, state=state)
        if self.loss == "sigmoid_binary_cross_entropy":
            z = out.reshape(-1).astype(np.float64)
            yy = y.reshape(-1)
            losses = np.maximum(z, 0) - z * yy + np.log1p(np.exp(-np.abs(z)))
            return float(losses.sum()), int(((z > 0) == (yy == 1)).sum()), int(yy.size)
        logits = out.reshape(-1, out.shape[-1]).astype(np.float64)
        yy = y.reshape(-1)
        shifted = logits - logits.max(axis=1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        rows = np.arange(yy.size)
        return (float(-logp[rows, yy].sum()), int((logits.argmax(axis=1) == yy).sum()),
                int(yy.size))

    def evaluate(self, core, params, x, y, *, state=None) -> tuple[float, float]:
        """Eval mode: (mean loss, accuracy in [0, 1]) on (x, y)."""
        loss_sum, correct, count = self.evaluate_sums(core, params, x, y, state=state)
        n = max(1, count)
        return loss_sum / n, correct / n

    def activation_bytes(self, batch: int, *, bytes_per_element: int = FLOAT32_BYTES) -> int:
        """Bytes the layers keep from forward for backward in one training step of
        ``batch`` examples: layer inputs of conv / dense / pooling, ReLU outputs,
        dropout masks, LSTM gates, plus the outputs; ``bytes_per_element`` each
        (float32 by default)."""
        per_example = sum(layer.cache_elements(s)
                          for layer, s in zip(self.layers, self._shapes, strict=False))
        per_example += math.prod(self.output_shape)
        return int(batch) * per_example * int(bytes_per_element)

    def activation_memory(self, batch: int, *, precision: str = "bf16", tensor: int = 1
                          ) -> ActivationMemory | None:
        """One device's activations for ``batch`` examples in the precision's dtype
        (``activation_bytes_per_element``). A model without a tensor-parallel
        program splits them evenly over ``tensor`` (a simplification: the
        planner only suggests such meshes); nothing is offloaded, no transient
        is modelled. Models with a layout of their own (the transformer)
        override this; None: the model cannot be split over ``tensor``."""
        nbytes = self.activation_bytes(
            batch, bytes_per_element=activation_bytes_per_element(precision))
        return ActivationMemory(-(-nbytes // int(tensor)))

    def largest_layer_params(self, tensor: int = 1) -> int:
        """Parameters of the largest layer on one of ``tensor`` devices: what an FSDP
        all-gather brings at once (split evenly over tensor; the transformer
        counts its own layout)."""
        largest = max((count for _, count in self.gradient_buckets()), default=self.num_params)
        return -(-largest // int(tensor))

    def forward_flops_per_example(self) -> int:
        """MXU FLOPs (2 per multiply-add) of one example's forward pass."""
        return sum(layer.forward_flops(s)
                   for layer, s in zip(self.layers, self._shapes, strict=False))

    def model_flops_per_example(self) -> int | None:
        """Model FLOPs per example of one training step as the published MFU tables
        count them (no recomputation), when they differ from the MXU FLOPs the step
        records; None: the recorded MXU FLOPs are the model FLOPs (no remat)."""
        return None

    def flops_per_example(self) -> int:
        """Training FLOPs per example: forward + backward = 3 x forward matmul
        FLOPs (backward = dX and dW, each the size of the forward product)."""
        return 3 * self.forward_flops_per_example()

    def summary_rows(self, batch: int | None = None) -> list[tuple[str, tuple, int, int]]:
        """Keras-like summary: (layer name, output shape with batch first,
        parameter count, forward MXU FLOPs per example) per layer."""
        return [(layer.name, (batch, *out), layer.param_count(s), layer.forward_flops(s))
                for layer, s, out in zip(self.layers, self._shapes, self._shapes[1:], strict=False)]
