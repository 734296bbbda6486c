"""The named models (``build_model``): the seed material's CNN, MLP and LSTMs, and
the decoder-only transformer. The ``Model`` class itself is ``pod.workloads.model``
(re-exported here)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pod.workloads.checks import DataMismatchError, check_int
from pod.workloads.layers import Conv2D, Dense, Dropout, Flatten, Layer, MaxPool2D, ReLU
from pod.workloads.model import FLOAT32_BYTES, LOSSES, Model  # noqa: F401 - re-exported
from pod.workloads.normalization import BatchNormalization
from pod.workloads.recurrent import LSTM, Embedding
from pod.workloads.resnet import build_resnet
from pod.workloads.transformer import TRANSFORMER_OPTIONS, build_transformer

MODEL_NAMES = ("cnn", "mlp", "lstm_classifier", "char_lstm", "transformer", "resnet")


def _dropout_rates(value, default: float, model: str) -> float:
    """dropout option -> rate: True -> default, False / 0 -> 0, float -> it."""
    if isinstance(value, bool):
        return default if value else 0.0
    if isinstance(value, (int, float)) and 0.0 <= float(value) < 1.0:
        return float(value)
    raise ValueError(f"{model}: option dropout must be true, false or a rate in [0, 1), "
                     f"got {value!r}")


def _cnn(input_shape, num_classes, dropout=True) -> list[Layer]:
    """The seed MNIST CNN, adapted to the input's size."""
    rates = (0.3, 0.3, 0.5) if dropout is True else (_dropout_rates(dropout, 0.0, "cnn"),) * 3
    if len(input_shape) != 3:
        raise DataMismatchError(f"cnn: input_shape must be (H, W, C), got {tuple(input_shape)}")
    layers = [Conv2D(64, 2, padding="same", name="conv1"), ReLU("relu1"),
              MaxPool2D(2, name="pool1"), Dropout(rates[0], "dropout1"),
              Conv2D(32, 2, padding="same", name="conv2"), ReLU("relu2"),
              MaxPool2D(2, name="pool2"), Dropout(rates[1], "dropout2"),
              Flatten("flatten"),
              Dense(256, "dense1"), ReLU("relu3"), Dropout(rates[2], "dropout3"),
              Dense(num_classes, "dense2")]
    return [layer for layer in layers if not (isinstance(layer, Dropout) and layer.rate == 0.0)]


def _mlp(input_shape, num_classes, hidden=(128, 64), dropout=False,
         batch_norm=False) -> list[Layer]:
    """Flatten, then per hidden width Dense (+ BatchNorm) + ReLU (+ Dropout), then Dense.

    The seed's CIFAR-10 MLP is hidden [2048, 1024, 512, 256, 128, 64, 32, 16],
    batch_norm true, dropout 0.5, 10 classes (softmax fused into the loss).
    """
    rate = _dropout_rates(dropout, 0.2, "mlp")
    if isinstance(hidden, (int, str)) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                 and h > 0 for h in hidden):
        raise ValueError(f"mlp: option hidden must be a list of positive integers, got {hidden!r}")
    if not isinstance(batch_norm, bool):
        raise ValueError(f"mlp: option batch_norm must be true or false, got {batch_norm!r}")
    layers: list[Layer] = [Flatten("flatten")]
    for i, width in enumerate(hidden, start=1):
        layers.append(Dense(width, f"dense{i}"))
        if batch_norm:
            layers.append(BatchNormalization(name=f"bn{i}"))
        layers.append(ReLU(f"relu{i}"))
        if rate > 0:
            layers.append(Dropout(rate, f"dropout{i}"))
    layers.append(Dense(num_classes, f"dense{len(hidden) + 1}"))
    return layers


def _positive_int(model: str, field: str, value) -> int:
    return check_int(value, f"{model}: option {field}")


def _lstm_classifier(input_shape, num_classes, vocabulary=15000, embedding_dim=32,
                     units=100) -> list[Layer]:
    """The seed IMDB model: Embedding(vocabulary, 32), LSTM(100), Dense(1)
    (+ sigmoid, fused into the binary cross-entropy). Inputs are token ids
    (B, T), T = 250 in the seed (reviews padded / truncated to 250)."""
    if len(input_shape) != 1:
        raise DataMismatchError(f"lstm_classifier: input_shape must be (steps,) token ids, "
                         f"got {tuple(input_shape)}")
    if num_classes != 2:
        raise DataMismatchError(f"lstm_classifier: classifies into 2 classes (binary), "
                                f"got {num_classes}")
    return [Embedding(_positive_int("lstm_classifier", "vocabulary", vocabulary),
                      _positive_int("lstm_classifier", "embedding_dim", embedding_dim),
                      name="embedding"),
            LSTM(_positive_int("lstm_classifier", "units", units), name="lstm"),
            Dense(1, "dense")]


def _char_lstm(input_shape, num_classes, embedding_dim=32, units=128) -> list[Layer]:
    """Next-character model: Embedding(V, embedding_dim), LSTM(units) over every
    step, Dense(V) at every step; V = num_classes (the characters). Inputs
    (B, T) character ids, labels (B, T) the next character at each step."""
    if len(input_shape) != 1:
        raise DataMismatchError(f"char_lstm: input_shape must be (steps,) character ids, "
                         f"got {tuple(input_shape)}")
    return [Embedding(num_classes, _positive_int("char_lstm", "embedding_dim", embedding_dim),
                      name="embedding"),
            LSTM(_positive_int("char_lstm", "units", units), return_sequences=True, name="lstm"),
            Dense(num_classes, "dense")]


def _transformer(input_shape, num_classes, **options) -> Model:
    """The decoder-only transformer (``pod.workloads.transformer``), a whole
    ``Model`` (it ties the embedding table across two layers)."""
    return build_transformer(input_shape, num_classes, **options)


def _resnet(input_shape, num_classes, **options) -> Model:
    """ResNet-18 / 34 / 50 / 101 / 152 or a smaller one (``pod.workloads.resnet``)."""
    return build_resnet(input_shape, num_classes, **options)


# name -> (builder: (input_shape, num_classes, **options) -> its layers or a Model,
# its options, its loss)
_BUILDERS: dict[str, tuple[Callable[..., Any], tuple[str, ...], str]] = {
    "cnn": (_cnn, ("dropout",), "softmax_cross_entropy"),
    "mlp": (_mlp, ("hidden", "dropout", "batch_norm"), "softmax_cross_entropy"),
    "lstm_classifier": (_lstm_classifier, ("vocabulary", "embedding_dim", "units"),
                        "sigmoid_binary_cross_entropy"),
    "char_lstm": (_char_lstm, ("embedding_dim", "units"), "softmax_cross_entropy"),
    "transformer": (_transformer, TRANSFORMER_OPTIONS, "softmax_cross_entropy"),
    "resnet": (_resnet, ("depth", "width", "blocks", "block", "stem"), "softmax_cross_entropy"),
}


#: The options each model takes.
MODEL_OPTIONS = {name: allowed for name, (_, allowed, _) in _BUILDERS.items()}


def build_model(name: str, input_shape: Sequence[int], num_classes: int, **options) -> Model:
    """Builds a model by name.

    Args:
        name: one of ``MODEL_NAMES``:
            "cnn" (option ``dropout``: true (the seed rates 0.3, 0.3, 0.5,
            default), false / 0 (none) or a rate for every dropout layer);
            "mlp" (options ``hidden``, default [128, 64]; ``dropout``: false
            (default), true (0.2) or a rate; ``batch_norm``: false (default));
            "lstm_classifier" (options ``vocabulary`` 15000, ``embedding_dim``
            32, ``units`` 100; inputs (T,) token ids, 2 classes);
            "char_lstm" (options ``embedding_dim`` 32, ``units`` 128; inputs
            (T,) character ids, labels (T,), num_classes = the characters);
            "transformer" (decoder-only language model, options
            ``TRANSFORMER_OPTIONS``: ``embed_dim`` 64, ``heads`` 4,
            ``kv_heads`` heads, ``head_dim`` embed_dim // heads, ``mlp_dim``
            4 * embed_dim, ``mlp_activation`` gated_silu | gated_gelu | gelu |
            relu, ``layers`` 2, ``norm`` rmsnorm | layernorm, ``positions``
            rotary | learned, ``tied_embeddings`` true, ``block`` sequential |
            parallel, ``use_bias`` false, ``fused_qkv`` false, ``attention``
            flash | dot_product, ``fusion`` true, ``remat``; inputs
            (T,) token ids, labels (T,), num_classes = the vocabulary; see
            ``pod.workloads.transformer``);
            "resnet" (options ``depth`` 50 (18, 34, 50, 101, 152), ``width`` 64,
            ``blocks`` (per stage; default the depth's), ``block`` basic |
            bottleneck (default the depth's), ``stem`` imagenet | small (default
            imagenet from 64x64 up); inputs (H, W, C) images; see
            ``pod.workloads.resnet``).
        input_shape: one example's shape, e.g. (8, 8, 1).
        num_classes: number of classes (>= 2).

    Raises:
        ValueError: unknown model name or option, or a bad value.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    builder, allowed, loss = _BUILDERS[name]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} for model {name!r}; "
                         f"allowed: {', '.join(allowed)}")
    check_int(num_classes, "num_classes", 2)
    shape = tuple(input_shape)
    if not shape or not all(isinstance(v, (int, np.integer)) and v > 0 for v in shape):
        raise ValueError(f"input_shape must be positive integers, got {input_shape!r}")
    built = builder(shape, num_classes, **options)
    if isinstance(built, Model):
        return built
    return Model(name, built, shape, num_classes, loss=loss)
