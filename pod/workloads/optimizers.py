"""Optimizers as pure init / update functions over flat dicts (optax style).

Every replica applies the update on its own copy of the parameters, so the
update must be deterministic: float32 elementwise arithmetic only (no
reductions, no threads), scalars precomputed once in float64 and cast to
float32. Inputs are never modified (they may be read-only views from Ray's
object store); every call returns new arrays. Elementwise work goes through
``vector_op`` (``core.vector``) so that it is costed on the VPU; on a timing-only
core only its cost is recorded and the results are zeros.

Each optimizer states its update of one parameter as a few elementwise ops
(``ElementwiseOp``). Run per parameter, that is three ops per parameter for
Adam, each a handful of numpy calls on a small array, with most of its time
Python. When every array is float32 and the core computes, ``Optimizer.update``
runs each op once over all the parameters at once instead (their arrays as
views into one contiguous buffer: :func:`flat_buffer`), the same float32
operations per element, so the same bits; then it records each parameter's
ops exactly as the per-parameter path does (``core.vector`` on that
parameter's own arrays), so the op records and the simulated clock are the
same. The parameters and state it returns are views into its fresh buffers,
so the next step finds them contiguous already.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from pod.workloads.checks import check_int, check_number
from pod.workloads.layers import vector_op
from pod.workloads.weights import BFLOAT16, stored

OPTIMIZER_NAMES = ("sgd", "adam", "adamw")

_F32 = np.float32


@dataclasses.dataclass(frozen=True)
class ElementwiseOp:
    """One elementwise op of a parameter's update, recorded on the VPU as
    ``"<optimizer>/<parameter><suffix>"``.

    Attributes:
        target: what it computes: "p" (the parameter) or a slot name.
        suffix: the record name's suffix ("" for the parameter, "/<slot>").
        fn: float32 numpy function of the inputs (never writes them; returns a new array).
        inputs: what it reads, in order: "g" (the gradient), "p" (the parameter) or a
            slot, each as the ops before it in the list left it.
        ops_per_element, transcendental: as ``core.vector``.
    """

    target: str
    suffix: str
    fn: Callable[..., np.ndarray]
    inputs: tuple[str, ...]
    ops_per_element: float
    transcendental: bool = False


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """Base class. Subclasses define ``slots`` (state arrays per parameter)
    and ``_ops`` (their update of one parameter as elementwise ops)."""

    name = "optimizer"
    # class attribute, not a field: state arrays per parameter
    slots: ClassVar[tuple[str, ...]] = ()

    def init(self, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """State: zeros like each parameter, one per slot, keyed "<param>/<slot>";
        float32, or bf16 for a bf16-stored parameter (optax keeps AdamW's moments in
        the parameters' dtype: ``pod.workloads.weights``)."""
        return {f"{key}/{slot}": np.zeros_like(v, dtype=_storage(v))
                for key, v in params.items() for slot in self.slots}

    def state_bytes(self, params: dict[str, np.ndarray]) -> int:
        """Bytes of the optimizer state for ``params``: per slot 4 per element, 2 for a
        bf16-stored parameter."""
        return len(self.slots) * sum(int(np.size(v)) * _storage(v).itemsize
                                     for v in params.values())

    def update(self, core, grads, state, params, step: int, *, each=None, flat: bool = True):
        """One update.

        Args:
            core: ``chip.TensorCore`` that runs and costs the elementwise work.
            grads: gradients, same keys and shapes as ``params``.
            state: from ``init`` or the previous ``update``.
            params: current parameters: float32, or ``ml_dtypes.bfloat16`` arrays
                (``weight_dtype: bfloat16``: the update is computed in float32 from
                the stored values and rounded back to bf16, gradients and state
                stored in bf16 too; its VPU records count 2 bytes per element).
            step: 1 for the first update, then 2, 3, ...
            each: None, or ``each(key, args, run)`` called for every parameter instead of
                ``run()``, its update (``args``: what it reads: the gradient, the state
                slots, the parameter, the step), returning what ``run()`` returns: a
                timing-only program replays it (``pod.programs.replay``).
            flat: compute every parameter's op at once when every array is float32,
                the core computes and ``each`` is None (module docstring); False: one
                parameter at a time (the same bits and records).

        Returns:
            (new_params, new_state), fresh dicts of fresh arrays in the parameters'
            storage dtype (float32, or bf16).

        Raises:
            ValueError: step < 1 or keys that do not match.
        """
        check_int(step, "step (counting from 1)")
        if grads.keys() != params.keys():
            raise ValueError(f"grads and params have different keys: {sorted(grads)} "
                             f"vs {sorted(params)}")
        if flat and each is None and core.execute:
            done = self._update_flat(core, grads, state, params, int(step))
            if done is not None:
                return done
        new_params, new_state = {}, {}
        for key, p in params.items():
            slots = {slot: state[f"{key}/{slot}"] for slot in self.slots}
            run = functools.partial(self._update_key, core, key, grads[key], slots, p, step)
            p_new, slots_new = run() if each is None else each(key, (grads[key], slots, p,
                                                                       int(step)), run)
            new_params[key] = p_new
            for slot, v in slots_new.items():
                new_state[f"{key}/{slot}"] = v
        return new_params, new_state

    def _update_key(self, core, key, g, slots, p, step):
        """One parameter's update, in its storage dtype: (new parameter, new state slots)."""
        dtype = _storage(p)
        env = {slot: stored(core, v, dtype) for slot, v in slots.items()}
        env["g"], env["p"] = stored(core, g, dtype), stored(core, p, dtype)
        for op in self._ops(int(step)):
            env[op.target] = _vector(core, f"{self.name}/{key}{op.suffix}", op.fn,
                                     *(env[i] for i in op.inputs), out=(p.shape, dtype),
                                     ops_per_element=op.ops_per_element,
                                     transcendental=op.transcendental)
        return env["p"], {slot: env[slot] for slot in slots}

    def _update_flat(self, core, grads, state, params, step: int):
        """``update`` with each op computed once over every parameter (module docstring),
        then recorded per parameter as ``_update_key`` records it (``core.vector`` on
        that parameter's arrays, returning its part of the result); None when an array
        is not float32 of its parameter's shape (the per-parameter path then runs)."""
        keys = list(params)
        per_key = {"p": [params[k] for k in keys], "g": [grads[k] for k in keys]}
        per_key.update({slot: [state[f"{k}/{slot}"] for k in keys] for slot in self.slots})
        shapes = [np.shape(p) for p in per_key["p"]]
        env: dict[str, np.ndarray] = {}
        for name, arrays in per_key.items():
            buffer = flat_buffer(arrays, shapes)
            if buffer is None:
                return None
            env[name] = buffer
        ops = self._ops(step)
        for op in ops:
            env[op.target] = op.fn(*(env[i] for i in op.inputs))
        bounds = np.cumsum([0, *(math.prod(shape) for shape in shapes)]).tolist()
        views = {op.target: [env[op.target][a:b].reshape(shape)
                             for a, b, shape in zip(bounds, bounds[1:], shapes, strict=False)]
                 for op in ops}
        for i, key in enumerate(keys):
            current = {name: arrays[i] for name, arrays in per_key.items()}
            for op in ops:
                args = [current[n] for n in op.inputs]
                result = current[op.target] = views[op.target][i]
                core.vector(f"{self.name}/{key}{op.suffix}", _returning(result), *args,
                            ops_per_element=op.ops_per_element, transcendental=op.transcendental)
        new_params = dict(zip(keys, views["p"], strict=True))
        new_state = {f"{k}/{slot}": views[slot][i] for i, k in enumerate(keys)
                     for slot in self.slots}
        return new_params, new_state

    def _ops(self, step: int) -> tuple[ElementwiseOp, ...]:
        """The update of one parameter at ``step`` (>= 1) as elementwise ops, in order."""
        raise NotImplementedError


def flat_buffer(arrays: Sequence[np.ndarray], shapes: Sequence[tuple[int, ...]]
                ) -> np.ndarray | None:
    """The float32 arrays laid end to end in one 1-D buffer, in order: the buffer they
    are views of when they tile it exactly in this order (no copy: what
    ``Optimizer.update`` returns), else a concatenated copy; None when an array is
    not a float32 ``np.ndarray`` of its shape in ``shapes``."""
    for a, shape in zip(arrays, shapes, strict=True):
        if type(a) is not np.ndarray or a.dtype != _F32 or a.shape != shape:
            return None
    filled = [a for a in arrays if a.size]  # an empty view's address is any
    base = filled[0].base if filled else None
    if (type(base) is np.ndarray and base.ndim == 1 and base.dtype == _F32
            and base.flags.c_contiguous):
        start = at = base.__array_interface__["data"][0]
        for a in filled:
            if (a.base is not base or not a.flags.c_contiguous
                    or a.__array_interface__["data"][0] != at):
                break
            at += a.nbytes
        else:
            if at == start + base.nbytes:
                return base
    return np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0, _F32)


def _returning(result: np.ndarray) -> Callable[..., np.ndarray]:
    """A function of any arguments that returns ``result`` (already computed)."""
    return lambda *_: result


def _storage(a) -> np.dtype:
    """The dtype the optimizer keeps a parameter's arrays in: bf16 for a bf16 array,
    else float32."""
    return BFLOAT16 if np.asarray(a).dtype == BFLOAT16 else np.dtype(_F32)


def _vector(core, name: str, fn, *arrays, out, **kw):
    """``vector_op``, computing in float32: with a bf16 ``out`` dtype the stored
    inputs are widened to float32, ``fn`` runs in float32 and its result is rounded
    to bf16 (round to nearest even)."""
    dtype = np.dtype(out[1])
    if dtype != _F32:
        inner = fn

        def fn(*a):
            return inner(*(np.asarray(x, _F32) for x in a)).astype(dtype)
    return vector_op(core, name, fn, *arrays, out=out, **kw)


def _check_positive(opt: str, field: str, value) -> float:
    return check_number(value, f"{opt}: {field}", low=0.0, low_open=True)


def _check_fraction(opt: str, field: str, value) -> float:
    return check_number(value, f"{opt}: {field}", low=0.0, high=1.0, high_open=True)


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """SGD with optional heavy-ball momentum (optax form):
    v = momentum * v + g;  p = p - learning_rate * v  (v = g when momentum 0)."""

    name = "sgd"
    learning_rate: float = 0.01
    momentum: float = 0.0

    def __post_init__(self):
        _check_positive("sgd", "learning_rate", self.learning_rate)
        _check_fraction("sgd", "momentum", self.momentum)

    @property
    def slots(self):
        return ("momentum",) if self.momentum else ()

    def _ops(self, step):
        lr, mu = _F32(self.learning_rate), _F32(self.momentum)
        if not self.momentum:
            return (ElementwiseOp("p", "", lambda p_, g_: p_ - lr * g_, ("p", "g"), 2.0),)
        return (ElementwiseOp("momentum", "/momentum", lambda v_, g_: mu * v_ + g_,
                              ("momentum", "g"), 2.0),
                ElementwiseOp("p", "", lambda p_, v_: p_ - lr * v_, ("p", "momentum"), 2.0))


def _adam_moments(name: str, beta1: float, beta2: float, step: int
                  ) -> tuple[tuple[ElementwiseOp, ElementwiseOp], np.float32, np.float32]:
    """Adam's first and second moments (ops "<name>/<key>/m", "/v") and its bias
    corrections 1 / (1 - beta ** step), computed once in float64 and applied in
    float32 (Kingma & Ba 2015, Algorithm 1). Returns ((m op, v op), inv_bc1, inv_bc2)."""
    b1, b2 = _F32(beta1), _F32(beta2)
    c1, c2 = _F32(1.0 - beta1), _F32(1.0 - beta2)
    inv_bc1 = _F32(1.0 / (1.0 - beta1 ** step))
    inv_bc2 = _F32(1.0 / (1.0 - beta2 ** step))

    def first(m_, g_):                                   # b1 * m + c1 * g
        out = np.multiply(m_, b1)
        out += np.multiply(g_, c1)
        return out

    def second(v_, g_):                                  # b2 * v + c2 * (g * g)
        out = np.multiply(v_, b2)
        sq = np.multiply(g_, g_)
        sq *= c2
        out += sq
        return out

    return ((ElementwiseOp("m", "/m", first, ("m", "g"), 3.0),
             ElementwiseOp("v", "/v", second, ("v", "g"), 4.0)), inv_bc1, inv_bc2)


def _adam_step(lr, inv_bc1, inv_bc2, eps):
    """p - lr * (m * inv_bc1) / (sqrt(v * inv_bc2) + eps) as a function of (p, m, v):
    the same float32 operations in the same order, into two temporaries (the inputs
    are not written)."""
    def step(p_, m_, v_):
        out = np.multiply(m_, inv_bc1)
        out *= lr
        den = np.multiply(v_, inv_bc2)
        np.sqrt(den, out=den)
        den += eps
        out /= den
        return np.subtract(p_, out, out=out)
    return step


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """Adam with bias correction (Kingma & Ba, eps outside the root):
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
    p = p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps),  t = step >= 1."""

    name = "adam"
    learning_rate: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-7
    slots = ("m", "v")

    def __post_init__(self):
        _check_positive("adam", "learning_rate", self.learning_rate)
        _check_fraction("adam", "beta1", self.beta1)
        _check_fraction("adam", "beta2", self.beta2)
        _check_positive("adam", "eps", self.eps)

    def _ops(self, step):
        moments, inv_bc1, inv_bc2 = _adam_moments("adam", self.beta1, self.beta2, step)
        lr, eps = _F32(self.learning_rate), _F32(self.eps)
        return (*moments, ElementwiseOp("p", "", _adam_step(lr, inv_bc1, inv_bc2, eps),
                                        ("p", "m", "v"), 6.0, transcendental=True))


@dataclasses.dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019), as
    ``optax.adamw``: m and v as Adam's, then
    p = p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p).

    The decay acts on every parameter (optax's default ``mask=None``) and is
    not scaled by the adaptive denominator; the defaults are optax's
    (b1 0.9, b2 0.999, eps 1e-8, weight_decay 1e-4).
    """

    name = "adamw"
    learning_rate: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-4
    slots = ("m", "v")

    def __post_init__(self):
        _check_positive("adamw", "learning_rate", self.learning_rate)
        _check_fraction("adamw", "beta1", self.beta1)
        _check_fraction("adamw", "beta2", self.beta2)
        _check_positive("adamw", "eps", self.eps)
        check_number(self.weight_decay, "adamw: weight_decay", low=0.0)

    def _ops(self, step):
        moments, inv_bc1, inv_bc2 = _adam_moments("adamw", self.beta1, self.beta2, step)
        lr, eps, wd = _F32(self.learning_rate), _F32(self.eps), _F32(self.weight_decay)
        return (*moments, ElementwiseOp(
            "p", "",
            lambda p_, m_, v_: p_ - lr * ((m_ * inv_bc1) / (np.sqrt(v_ * inv_bc2) + eps) + wd * p_),
            ("p", "m", "v"), 8.0, transcendental=True))


_OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def build_optimizer(name: str, **options) -> Optimizer:
    """Builds an optimizer by name.

    Args:
        name: "sgd" (options learning_rate=0.01, momentum=0.0), "adam"
            (learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-7) or "adamw"
            (learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=1e-4; optax semantics).

    Raises:
        ValueError: unknown name, unknown option, or a bad value.
    """
    if name not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZER_NAMES)}")
    cls = _OPTIMIZERS[name]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} for optimizer "
                         f"{name!r}; allowed: {', '.join(allowed)}")
    return cls(**options)
