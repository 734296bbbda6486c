"""Sampling text from a trained ``char_lstm``, one character at a time.

The LSTM's state is carried from character to character (``LSTM.step``), so
generating N characters costs N steps, not N windows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pod.workloads.checks import check_int
from pod.workloads.layers import Dense
from pod.workloads.models import Model
from pod.workloads.recurrent import LSTM, Embedding
from pod.workloads.transformer import TransformerModel

__all__ = ["sample_text", "MAX_GENERATE_CHARS", "checkpoint_model"]

#: Most characters one ``tpu-pod generate`` samples (each is a step of the model on one
#: TensorCore, about a millisecond: 100,000 take minutes; memory stays small).
MAX_GENERATE_CHARS = 100_000
#: Longest prompt, in characters (the transformer runs its window over it).
MAX_PROMPT_CHARS = 100_000


def sample_text(core, model: Model, params: dict[str, np.ndarray], vocabulary: str, *,
                prompt: str = "", length: int = 200, temperature: float = 1.0,
                seed: int = 0) -> str:
    """Continues ``prompt`` with ``length`` sampled characters.

    Args:
        core: the ``chip.TensorCore`` that runs (and costs) the steps.
        model: a ``char_lstm`` (Embedding, LSTM over every step, Dense), or a
            ``transformer`` (each new character runs its window's forward).
        params: its parameters.
        vocabulary: the characters; id i is ``vocabulary[i]``.
        prompt: text to start from (every character must be in the vocabulary);
            empty: start from a newline, or the first character.
        length: characters to generate (>= 1).
        temperature: > 0; lower is more conservative, 0 < t; logits / t.
        seed: seed of the sampling generator.

    Returns:
        The generated characters (without the prompt).

    Raises:
        ValueError: not a char_lstm, a prompt character outside the
            vocabulary, or a bad length / temperature.
    """
    check_int(length, "length", 1)
    if length > MAX_GENERATE_CHARS or len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"--length: at most {MAX_GENERATE_CHARS:,} characters (and a prompt of "
                         f"at most {MAX_PROMPT_CHARS:,}), got {length:,} (prompt {len(prompt):,})")
    if isinstance(model, TransformerModel):
        return _sample_transformer(core, model, params, vocabulary, prompt=prompt, length=length,
                                   temperature=temperature, seed=seed)
    layers = model.layers
    emb, lstm, dense = layers if len(layers) == 3 else (None, None, None)
    if not (isinstance(emb, Embedding) and isinstance(lstm, LSTM) and isinstance(dense, Dense)):
        raise ValueError(f"generate needs a char_lstm model (Embedding, LSTM, Dense), "
                         f"got {model.name!r}")
    check_int(length, "length")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    index, start = _prompt(model, vocabulary, prompt)
    local = model.prepare_params(core, params)
    rng = np.random.default_rng(seed)
    h = np.zeros((1, lstm.units), np.float32)
    c = np.zeros((1, lstm.units), np.float32)
    out = []

    def feed(char_id: int) -> np.ndarray:
        nonlocal h, c
        e, _ = emb.forward(core, local[0], np.array([[char_id]]))          # (1, 1, E)
        zx = core.matmul(e[:, 0], local[1]["kernel"], name="lstm/fwd_input") + local[1]["bias"]
        h, c, _ = lstm.step(core, local[1], zx, h, c)                      # (1, H)
        logits, _ = dense.forward(core, local[2], h)                       # (1, V)
        return logits[0].astype(np.float64)

    for ch in start:
        logits = feed(index[ch])
    for _ in range(length):
        z = logits / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        nxt = int(rng.choice(len(p), p=p))
        out.append(vocabulary[nxt])
        logits = feed(nxt)
    core.take_records()
    return "".join(out)


def _prompt(model: Model, vocabulary: str, prompt: str) -> tuple[dict[str, int], str]:
    """The vocabulary's index and the text to start from (the prompt, or a newline /
    the first character when it is empty).

    Raises:
        ValueError: a vocabulary of another size than the model's, or a prompt
            character outside it.
    """
    if len(vocabulary) != model.num_classes:
        raise ValueError(f"the vocabulary has {len(vocabulary)} characters, "
                         f"the model {model.num_classes}")
    index = {c: i for i, c in enumerate(vocabulary)}
    unknown = sorted({c for c in prompt if c not in index})
    if unknown:
        raise ValueError(f"prompt characters {''.join(unknown)!r} are not in the model's "
                         "vocabulary")
    return index, prompt or ("\n" if "\n" in index else vocabulary[0])


def _sample_transformer(core, model: TransformerModel, params: dict[str, np.ndarray],
                        vocabulary: str, *, prompt: str, length: int, temperature: float,
                        seed: int) -> str:
    """``sample_text`` for a transformer: the prompt's ids, ``TransformerModel.sample``."""
    index, start = _prompt(model, vocabulary, prompt)
    ids = model.sample(core, params, [index[c] for c in start], length=length,
                       temperature=temperature, seed=seed)
    return "".join(vocabulary[i] for i in ids)


def checkpoint_model(ckpt, source: str) -> tuple[Model, str, str]:
    """The text model a checkpoint holds, checked before a character is sampled: the
    model its scenario and extra data declare (built: its options within the model's
    bounds), and parameters that are that model's (names, shapes, float32, finite),
    so nothing is sized by a declaration alone.

    Returns:
        (the model, its vocabulary, the chip preset the run used).

    Raises:
        CheckpointError: not a char_lstm or transformer checkpoint of a text run, a
            model that does not build, or parameters of another model (one line).
    """
    from pod.errors import CheckpointError
    from pod.state.checks import check_params
    from pod.workloads import build_model

    def mapping(value: Any) -> dict[str, Any]:
        return value if isinstance(value, dict) else {}

    extra, scenario = mapping(ckpt.extra), mapping(ckpt.scenario)
    options = mapping(scenario.get("model")).get("options") or {}
    shape, classes, vocabulary = (extra.get("input_shape"), extra.get("num_classes"),
                                  extra.get("vocabulary"))
    if extra.get("model") not in ("char_lstm", "transformer") or not isinstance(vocabulary, str) \
            or not vocabulary:
        raise CheckpointError(f"{source}: generate needs a char_lstm or transformer checkpoint "
                              f"of a text run, this one holds {str(extra.get('model'))[:40]!r}")
    try:
        if not isinstance(options, dict) or not isinstance(shape, list) or \
                not isinstance(classes, int):
            raise TypeError("its model options, input shape or classes are not a mapping, a "
                            "list and a number")
        model = build_model(extra["model"], tuple(shape), classes, **options)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: the checkpoint's model does not build "
                              f"({str(err)[:200]})") from None
    check_params(ckpt, model, source)
    chip = mapping(scenario.get("pod")).get("chip")
    return model, vocabulary, chip if isinstance(chip, str) else "v2"
