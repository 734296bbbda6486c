"""The mixture-of-experts feed-forward layer (MoE): a router, top-k of E experts per
token, expert MLPs, capacity, the load-balancing loss.

Per sequence of T tokens x (T, C) (the block's normed input), E experts, k per token:

    logits = x Wr                                        # (T, E) router, MXU
    p = softmax(logits)                                  # (T, E) for the balancing loss
    choice = top_k(logits)                               # (T, k) the k best experts
    gate = softmax(logits[choice])                       # (T, k) over the k chosen only
    y_t = sum_j gate_tj * expert_{choice_tj}(x_t)        # (C,) each expert a gated MLP

The gate is the softmax over the top-k logits ([Mixtral] Jiang et al. 2024, eq. 1:
G(x) = Softmax(TopK(x Wg)); MaxText ``moe.py`` ``get_topk``, every decoder but
DeepSeek's), not the top-k of a softmax over all E (GShard / Switch, whose gates do
not sum to 1). Ties go to the lower expert index (``jax.lax.top_k``). Every expert is
the block's MLP (``pod.workloads.mlp``: ``gated_silu`` is Mixtral's SwiGLU) with its
own weights: ``wi_0``, ``wi_1`` (E, C, F) and ``wo`` (E, F, C), or ``wi`` for an
ungated activation; the router is ``router`` (C, E).

**Capacity** ([Switch] Fedus et al. 2021, sec. 2.2; MaxText ``generate_masks``):
with ``capacity_factor`` cf > 0 an expert takes at most ``cap = floor(T k cf / E)``
of a sequence's token choices (at most T), in token order and, within a token, its
first choice before its second (the cumulative count over the (T k) choices that
MaxText takes); the others are dropped: their gate weight is lost (not
renormalised) and the residual carries the token on. Every expert then computes on
a (cap,)-row buffer per sequence, padded with zeros: static shapes, the cost of
XLA's dropping implementation. With cf = 0 (dropless, MaxText's ``capacity_factor:
-1`` and megablox) every choice is kept; the choices are sorted by expert and the
experts run as one grouped matmul over the T k rows
(``chip.TensorCore.grouped_matmul``), costed as E equal groups.

**Dense einsum dispatch** (``sparse_matmul`` False; MaxText ``moe.py``
``dense_matmul`` with ``capacity_factor`` > 0, the path of ``megablox: false`` at
2e1ebad7, training-steps.md T8): the routing as two (tokens, experts, capacity)
masks per sequence, built by ``generate_masks`` (the same capacity rule): a 0/1
dispatch mask and a combine mask holding each kept choice's gate, both in the
activation dtype. The tokens reach the expert buffer by an MXU product,
``einsum("BSM,BSEC->EBCM")`` ((E cap, T) x (T, C) per sequence), and come back by
another, ``einsum("EBCM,BSEC->BSM")`` ((T, E cap) x (E cap, C)); in backward the
combine's two operand gradients (the expert outputs', and the combine mask's, from
which the gates' gradients are read) and the dispatch's input gradient are three
more such products. Each costs 2 T E cap C FLOPs per sequence: hardware work that
MaxText's model FLOPs do not count (about 2.5 T C per token and product at E cap =
1.25 k T for Mixtral's k 2), beside the masks' HBM traffic (2 bytes per element, T
E cap each). The values are those of the gather and scatter above (a one-hot
product selects rows exactly); the combine mask's gates are rounded to bf16 as the
MXU reads them.

**Dense dropless** (``sparse_matmul`` False with cf 0; MaxText ``dense_matmul``
without a capacity: ``einsum("BSM,EMH->BSEH")`` ... ``einsum("BSEM,BSE->BSM")``):
every expert computes every token, and the combine weighs each token's k chosen
experts by their gates (the others by 0). No masks and no dispatch product: the
expert products read the tokens as they are (their E T rows per sequence costed by
the grouped products), and the combine and its gradients are weighted sums on the
VPU over the E rows of a token. Its values are the capacity path's with a capacity
of T (no choice dropped): a row of an expert a token did not choose computes from
zeros here and from the token there, and either way its weight is 0, so its output
and every gradient it feeds are 0 (``act(0) = 0`` for every activation here). Over an
expert axis its buffers are E T rows per sequence, equal for every expert: no ragged
all-to-all.

**Load balancing** ([Switch] eq. 4, [GShard] sec. 2.2; MaxText
``load_balance_loss``): per sequence, f_e is the share of the T k choices routed to
expert e (before capacity) and P_e the mean of p_te over its tokens;
``aux = w E sum_e f_e P_e`` (w: ``aux_loss_weight``, MaxText
``load_balance_loss_weight``, default 0.01), averaged over the sequences. f is a
count (no gradient); the gradient flows through P into the router. It is k w for a
uniform router.

**Experts on other devices** (:class:`ExpertHooks`): the layer lays the dispatched
tokens out expert-major, ``(E, R, C)`` with R rows per expert (``b cap`` for b
sequences); ``hooks.dispatch`` takes them to the devices holding the experts and
returns the rows of this device's E / s experts from the s devices, ``(E / s, s R,
C)``; ``hooks.combine`` takes the experts' outputs back. On one device both are the
identity; ``pod.programs.experts`` runs them as all-to-alls over the mesh's
``expert`` axis. The router is replicated, so routing, capacity and the balancing
loss are each device's own, on its own sequences.

Products on the MXU (the router, the grouped expert products), routing, dispatch,
combine and the activation on the VPU. With ``fusion`` (``pod.workloads.fusion``)
the elementwise work joins a matmul: the routing (a row's softmax and top-k over
E) the router product's epilogue, the activation and its gradient the grouped
products' as the dense MLP's, the sums of input-gradient parts and the routing's
gradient their matmuls'; the dispatch and combine (gathers and scatters of rows)
stay ops of their own with their HBM traffic. On a timing-only core (``core.execute``
False) the same ops are recorded from shapes and nothing data-dependent runs (zero
views, E / s equal groups). The layer's routing of a pass comes back as a
:class:`RouterLoad` (the block puts it in its cache under "moe").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from chip import to_bf16
from pod.workloads.checks import check_int
from pod.workloads.fusion import after, epilogue, prologue
from pod.workloads.layers import Layer, glorot_uniform, mxu_input, timing_zeros, vector_op
from pod.workloads.mlp import _ACTIVATIONS, MLP_ACTIVATIONS, activation_backward, add

__all__ = ["MoE", "ExpertHooks", "RouterLoad", "expert_capacity", "route_tokens"]

_I32 = np.int32


@dataclass(frozen=True)
class RouterLoad:
    """One MoE layer's routing of one device's tokens in one pass.

    Attributes:
        routed: per expert, the token choices routed to it (top-k, before capacity).
        kept: per expert, those kept under the capacity (``routed`` when dropless).
        aux_loss: the layer's weighted load-balancing loss on these tokens.

    Both tuples are empty on a timing-only core (nothing is routed).
    """

    routed: tuple[int, ...]
    kept: tuple[int, ...]
    aux_loss: float

    @property
    def dropped(self) -> int:
        """Token choices over capacity."""
        return int(sum(self.routed) - sum(self.kept))


class ExpertHooks:
    """How the dispatched tokens reach the experts and come back: the identity of one
    device holding every expert (``pod.programs.experts`` has the all-to-all ones).

    Attributes:
        shards: devices the experts are split over (s).
    """

    shards = 1

    def dispatch(self, tag: str, rows: np.ndarray, experts: int) -> np.ndarray:
        """(E R, C) rows, expert-major, on the token side -> (E/s s R, C): this
        device's E / s experts' rows from every device (expert, then source)."""
        return rows

    def combine(self, tag: str, rows: np.ndarray, experts: int) -> np.ndarray:
        """The inverse of :meth:`dispatch`: (E/s s R, C) expert outputs -> (E R, C)."""
        return rows


_ONE_DEVICE = ExpertHooks()


def expert_capacity(tokens: int, experts: int, experts_per_token: int,
                    capacity_factor: float) -> int:
    """Token choices one expert takes from a sequence of ``tokens``: ``floor(T k cf /
    E)``, at most T ([Switch] sec. 2.2, MaxText ``expert_capacity_per_batch``); 0
    when dropless (``capacity_factor`` 0)."""
    if capacity_factor <= 0:
        return 0
    return min(int(tokens), int(tokens * experts_per_token * capacity_factor / experts))


def route_tokens(logits: np.ndarray, sequences: int, k: int, capacity: int):
    """Routing of (N, E) router logits, N = sequences x T: numpy, on the VPU.

    Returns:
        (probs (N, E) softmax over all experts; gates (N, k) softmax over the chosen
        logits; choice (N, k) int32 experts, best first; slot (N, k) int32 row of
        each choice in the dispatch buffer, -1 when dropped). The buffer is
        expert-major: with a capacity, (E, sequences, capacity) rows; dropless, the
        N k choices sorted by expert (stable).
    """
    n, e = logits.shape
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = z / z.sum(axis=1, keepdims=True)
    choice = np.argsort(-logits, axis=1, kind="stable")[:, :k].astype(_I32)
    top = np.take_along_axis(logits, choice, axis=1)
    g = np.exp(top - top[:, :1])
    gates = g / g.sum(axis=1, keepdims=True)
    if capacity <= 0:
        flat = choice.reshape(-1)
        slot = np.empty(flat.size, _I32)
        slot[np.argsort(flat, kind="stable")] = np.arange(flat.size, dtype=_I32)
        return probs, gates, choice, slot.reshape(n, k)
    t = n // sequences
    per_seq = choice.reshape(sequences, t * k)                           # token-major choices
    onehot = per_seq[:, :, None] == np.arange(e)                         # (b, T k, E)
    before = np.cumsum(onehot, axis=1) - 1                               # earlier same-expert
    pos = np.take_along_axis(before, per_seq[:, :, None], axis=2)[:, :, 0]
    seq = np.arange(sequences)[:, None]
    slot = np.where(pos < capacity, (per_seq * sequences + seq) * capacity + pos, -1)
    return probs, gates, choice, slot.reshape(n, k).astype(_I32)


def _dispatch(x: np.ndarray, slot: np.ndarray, rows: int) -> np.ndarray:
    """The dispatch buffer (rows, C): x's token at each kept slot, zeros elsewhere."""
    out = np.zeros((rows, x.shape[1]), x.dtype)
    token, j = np.nonzero(slot >= 0)
    out[slot[token, j]] = x[token]
    return out


def _combine(rows: np.ndarray, gates: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """y (N, C) = sum_j gate_tj * rows[slot_tj] over the kept choices."""
    y = np.zeros((slot.shape[0], rows.shape[1]), rows.dtype)
    for j in range(slot.shape[1]):
        kept = slot[:, j] >= 0
        y[kept] += gates[kept, j, None].astype(rows.dtype) * rows[slot[kept, j]]
    return y


def _combine_grad(dy: np.ndarray, rows: np.ndarray, gates: np.ndarray, slot: np.ndarray):
    """(d rows (R, C), d gates (N, k)) of :func:`_combine`."""
    drows = np.zeros_like(rows, dtype=dy.dtype)
    dgates = np.zeros(gates.shape, gates.dtype)
    for j in range(slot.shape[1]):
        kept = np.flatnonzero(slot[:, j] >= 0)
        drows[slot[kept, j]] = gates[kept, j, None].astype(dy.dtype) * dy[kept]
        dgates[kept, j] = np.einsum("nc,nc->n", dy[kept], rows[slot[kept, j]])
    return drows, dgates


def _dispatch_grad(drows: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """dx (N, C) of :func:`_dispatch`: the sum of each token's kept rows' gradients."""
    dx = np.zeros((slot.shape[0], drows.shape[1]), drows.dtype)
    for j in range(slot.shape[1]):
        kept = slot[:, j] >= 0
        dx[kept] += drows[slot[kept, j]]
    return dx


def _router_grad(dgates, probs, gates, choice, density, weight: float):
    """d logits (N, E): the gates' softmax over the chosen logits, plus the balancing
    loss through P (``density`` (b, E): f_e per sequence, already times w E / b / T)."""
    dtop = gates * (dgates - (gates * dgates).sum(axis=1, keepdims=True))   # (N, k)
    dl = np.zeros(probs.shape, probs.dtype)
    np.put_along_axis(dl, choice, dtop.astype(probs.dtype), axis=1)
    if weight:
        b, e = density.shape
        dp = np.repeat(density, probs.shape[0] // b, axis=0).astype(probs.dtype)  # (N, E)
        dl += probs * (dp - (probs * dp).sum(axis=1, keepdims=True))
    return dl


class MoE(Layer):
    """The mixture-of-experts feed-forward layer over (B, T, C) (module docstring).

    Args:
        experts: E, experts (>= 2).
        experts_per_token: k, 1 <= k <= E.
        mlp_dim: F, each expert's hidden width.
        activation: one of ``MLP_ACTIVATIONS``.
        capacity_factor: cf >= 0; 0: dropless.
        aux_loss_weight: w >= 0, the load-balancing loss's weight.
        expert_shards: s, devices the experts are split over; this layer's params
            hold E / s experts (the router all E).
        sparse_matmul: True: the gather / scatter dispatch and grouped matmuls;
            False: the dense einsum dispatch (with cf 0: dense dropless, every expert
            on every token; module docstring).
        quantized: AQT int8 products for the experts (``pod.workloads.quantization``).
        fusion: fuse the elementwise work into the matmuls (module docstring).
        name: layer name.

    Raises:
        ValueError: a bad count or factor, or s not dividing E (one line).
    """

    kind = "moe"

    def __init__(self, experts: int, experts_per_token: int, mlp_dim: int,
                 activation: str = "gated_silu", *, capacity_factor: float = 0.0,
                 aux_loss_weight: float = 0.01, expert_shards: int = 1, fusion: bool = False,
                 sparse_matmul: bool = True, quantized: bool = False, name: str | None = None):
        super().__init__(name)
        self.fusion = bool(fusion)
        # AQT int8: the experts' products; the router and the dense dispatch stay bf16
        self.q8 = {"quantized": True} if quantized else {}
        self.experts = check_int(experts, "MoE experts")
        self.k = check_int(experts_per_token, "MoE experts_per_token")
        self.mlp_dim = check_int(mlp_dim, "MoE mlp_dim")
        self.shards = check_int(expert_shards, "MoE expert_shards")
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"MoE activation must be one of {', '.join(MLP_ACTIVATIONS)}, "
                             f"got {activation!r}")
        if self.k > self.experts or self.experts % self.shards:
            raise ValueError(f"MoE: experts_per_token {self.k} and expert shards {self.shards} "
                             f"must be at most and divide experts {self.experts}")
        if not capacity_factor >= 0 or not aux_loss_weight >= 0:
            raise ValueError(f"MoE: capacity_factor {capacity_factor!r} and aux_loss_weight "
                             f"{aux_loss_weight!r} must be numbers >= 0")
        self.activation, self.gated = activation, activation.startswith("gated_")
        self.capacity_factor, self.aux_loss_weight = float(capacity_factor), float(aux_loss_weight)
        self.dense = not sparse_matmul
        #: MaxText's dense_matmul without a capacity: every expert on every token
        self.dense_dropless = self.dense and self.capacity_factor <= 0
        self.local_experts = self.experts // self.shards
        self.inputs = ("wi_0", "wi_1") if self.gated else ("wi",)
        self.matmul_params = ("router", *self.inputs, "wo")
        #: the expert weights are split over the mesh's expert axis on their first dimension
        self.expert_split = MappingProxyType({k: 0 for k in (*self.inputs, "wo")})
        self.dot_keys = ("u0", "u1") if self.gated else ("u",)
        self.backward_keys = ("x", "route", "xd", *self.dot_keys, "g", "rows")

    @property
    def _combined(self) -> int:
        """Expert rows a token's combine (and its gradients) reads: its k choices, or
        every expert's under dense dropless (``einsum("BSEM,BSE->BSM")``)."""
        return self.experts if self.dense_dropless else self.k

    # ------------------------------------------------------------ shapes

    def capacity(self, tokens: int) -> int:
        """:func:`expert_capacity` of a sequence of ``tokens`` (0: dropless); dense
        dropless: T, every expert takes every token."""
        if self.dense_dropless:
            return int(tokens)
        return expert_capacity(tokens, self.experts, self.k, self.capacity_factor)

    def slots(self, tokens: int) -> int:
        """Dispatch-buffer rows per sequence: E x capacity, or T k dropless."""
        cap = self.capacity(tokens)
        return self.experts * cap if cap else tokens * self.k

    def param_shapes(self, input_shape):
        c, f, e = int(input_shape[-1]), self.mlp_dim, self.local_experts
        return {"router": (c, self.experts), **{w: (e, c, f) for w in self.inputs},
                "wo": (e, f, c)}

    def init_params(self, rng, input_shape):
        c = int(input_shape[-1])
        out = {"router": glorot_uniform(rng, (c, self.experts), c, self.experts)}
        for w, s in self.param_shapes(input_shape).items():
            if w != "router":
                out[w] = glorot_uniform(rng, s, s[1], s[2])
        return out

    def forward_flops(self, input_shape):
        """Active FLOPs per example: the router and k experts' MLPs per token."""
        t, c = math.prod(input_shape[:-1]), int(input_shape[-1])
        return 2 * t * c * self.experts + self.k * 2 * t * c * self.mlp_dim * (len(self.inputs) + 1)

    def input_flops(self, input_shape) -> int:
        """FLOPs of one expert input projection per example, over its dispatch slots."""
        return 2 * self.slots(int(input_shape[0])) * int(input_shape[-1]) * self.mlp_dim

    def recompute_extra_flops(self, input_shape) -> int:
        """MXU FLOPs a remat pass redoes besides the input projections: the router and the
        output projection (backward needs every expert's output for the gates), and the
        dense dispatch's product (not the combine's: its output is not needed)."""
        t, c = int(input_shape[0]), int(input_shape[-1])
        return (2 * t * c * self.experts + self.input_flops(input_shape)
                + self.dispatch_flops(input_shape) // 5)

    def dot_elements(self, input_shape) -> int:
        """Elements of the expert input products per example."""
        return len(self.inputs) * self.slots(int(input_shape[0])) * self.mlp_dim

    def cache_elements(self, input_shape):
        """Per example what backward reads: x, the router's probabilities, the gates,
        choices and slots, the dispatched and combined rows, the expert products;
        with the dense dispatch its two (T, E, cap) masks too."""
        t, c = int(input_shape[0]), int(input_shape[-1])
        s = self.slots(t)
        return (t * c + t * self.experts + 3 * t * self.k + 2 * s * c
                + (len(self.inputs) + 1) * s * self.mlp_dim + self.mask_elements(t))

    def mask_elements(self, tokens: int) -> int:
        """Elements of the dense dispatch's two masks per sequence, 2 T E cap (0 with
        the sparse dispatch)."""
        return 2 * tokens * self.slots(tokens) if self.dense and not self.dense_dropless else 0

    def dispatch_flops(self, input_shape) -> int:
        """MXU FLOPs per example of the dense dispatch's products in one training step
        without recomputation: 2 forward (dispatch, combine) and 3 backward, each 2 T
        (E cap) C; 0 with the sparse dispatch (its gathers run on the VPU)."""
        if not self.dense or self.dense_dropless:
            return 0
        t, c = int(input_shape[0]), int(input_shape[-1])
        return 5 * 2 * t * self.slots(t) * c

    # ------------------------------------------------------------ passes

    def _route(self, core, logits: np.ndarray, b: int, t: int) -> dict[str, Any]:
        """The routing op (VPU) and its bookkeeping: the cache's "route"."""
        n, e, k = logits.shape[0], self.experts, self.k
        cap = self.capacity(t)
        outs = [((n, e), logits.dtype), ((n, k), logits.dtype), ((n, k), _I32), ((n, k), _I32)]
        probs, gates, choice, slot = vector_op(
            core, f"{self.name}/route", lambda z: route_tokens(z, b, k, cap), logits, out=outs,
            ops_per_element=7.0 + 2.0 * k, transcendental=True, fused=epilogue(self.fusion))
        rows = b * self.slots(t)
        route = {"probs": probs, "gates": gates, "choice": choice, "slot": slot, "rows": rows,
                 "sequences": b}
        if not core.execute:  # nothing routed: E / s equal groups, no load
            route.update(groups=self.local_experts, density=None,
                         load=RouterLoad((), (), 0.0))
            return route
        counts = np.stack([np.bincount(c, minlength=e) for c in choice.reshape(b, t * k)])
        density = counts / t                                             # (b, E): f_e
        mean_p = probs.reshape(b, t, e).mean(axis=1)                     # (b, E): P_e
        aux = self.aux_loss_weight * e * float((density * mean_p).sum(axis=1).mean())
        routed = counts.sum(axis=0)
        kept = np.bincount(choice[slot >= 0], minlength=e) if cap else routed
        groups = ([self.shards * b * cap] * self.local_experts if cap
                  else np.bincount(choice.reshape(-1), minlength=e))
        route.update(groups=groups, density=density * (self.aux_loss_weight * e / (b * t)),
                     load=RouterLoad(tuple(int(v) for v in routed), tuple(int(v) for v in kept),
                                     aux))
        return route

    def _activate(self, core, u, ran: bool):
        """act(u): the input products' epilogue when they ran, else the next matmul's."""
        fn, ops, transcendental, _ = _ACTIVATIONS[self.activation]
        return vector_op(core, f"{self.name}/{self.activation}", fn, *u,
                         out=(u[0].shape, u[0].dtype), ops_per_element=ops,
                         transcendental=transcendental, fused=after(self.fusion, ran))

    def forward(self, core, params, x, *, training=False, rng=None, saved=None, need_output=True,
                experts: ExpertHooks | None = None):
        """As ``Layer.forward`` over x (B, T, C). ``saved`` (remat): expert input products
        kept from the first forward; ``need_output`` False (remat's rerun) skips only the
        final weighted sum; ``experts``: the hooks that reach experts on other devices.

        Returns:
            (y (B, T, C), cache); ``cache["route"]["load"]`` is the :class:`RouterLoad`.
        """
        hooks = experts or _ONE_DEVICE
        if x.ndim != 3:
            raise ValueError(f"{self.name}: the MoE layer takes (B, T, C) sequences, got "
                             f"{x.shape}")
        b, t, c = x.shape
        xr = mxu_input(core, x).reshape(-1, c)                           # (N, C)
        logits = core.matmul(xr, params["router"], name=f"{self.name}/router", a_rounded=True,
                             b_rounded=True)                             # (N, E)
        route = self._route(core, logits, b, t)
        n_rows = route["rows"]
        if self.dense_dropless:  # the tokens as they are: E T rows read by the products
            rows = (_dispatch(xr, route["slot"], n_rows) if core.execute
                    else timing_zeros((n_rows, c), xr.dtype))
        elif self.dense:
            rows = self._dense_dispatch(core, xr, route, b, t)
        else:
            rows = vector_op(core, f"{self.name}/dispatch", lambda z, s: _dispatch(z, s, n_rows),
                             xr, route["slot"], out=((n_rows, c), xr.dtype))  # (E R, C)
        xd = hooks.dispatch(f"{self.name}/dispatch", rows, self.experts)     # (E/s s R, C)
        groups = route["groups"]
        u = [saved[key] if saved is not None and key in saved else
             core.grouped_matmul(xd, params[w], groups, name=f"{self.name}/{w}", a_rounded=True,
                                 b_rounded=True, **self.q8)
             for key, w in zip(self.dot_keys, self.inputs, strict=True)]  # (E/s s R, F) each
        ran = not (saved is not None and self.dot_keys[-1] in saved)
        g = mxu_input(core, self._activate(core, u, ran))
        ye = core.grouped_matmul(g, params["wo"], groups, name=f"{self.name}/wo",
                                 a_rounded=True, b_rounded=True, **self.q8)         # (E/s s R, C)
        back = hooks.combine(f"{self.name}/combine", ye, self.experts)   # (E R, C)
        cache = {"x": xr, "route": route, "xd": xd, **dict(zip(self.dot_keys, u, strict=True)),
                 "g": g, "rows": back}
        if not need_output:
            return None, cache
        if self.dense and not self.dense_dropless:
            y = self._dense_combine(core, back, route, b, t)
        else:
            y = vector_op(core, f"{self.name}/combine", _combine, back, route["gates"],
                          route["slot"], out=((b * t, c), back.dtype),
                          ops_per_element=2.0 * self._combined)
        return y.reshape(b, t, c), cache

    def backward(self, core, params, cache, dy, *, need_dx=True,
                 experts: ExpertHooks | None = None):
        """As ``Layer.backward``; the balancing loss's gradient is added to the router's."""
        hooks = experts or _ONE_DEVICE
        route, xr, xd, g = cache["route"], cache["x"], cache["xd"], cache["g"]
        lead, c = dy.shape[:-1], dy.shape[-1]
        dyr = dy.reshape(-1, c)                                          # (N, C)
        rows, groups = cache["rows"], route["groups"]
        if self.dense and not self.dense_dropless:
            drows, dgates = self._dense_combine_grad(core, dyr, rows, route)
        else:
            drows, dgates = vector_op(
                core, f"{self.name}/combine_bwd", _combine_grad, dyr, rows, route["gates"],
                route["slot"], out=[(rows.shape, dyr.dtype), (route["gates"].shape,
                                                              route["gates"].dtype)],
                ops_per_element=2.0 * self._combined)
        dye = mxu_input(core, hooks.dispatch(f"{self.name}/combine_bwd", drows, self.experts))
        grads = {"wo": core.grouped_transposed_matmul(g, dye, groups, name=f"{self.name}/d_wo",
                                                      a_rounded=True, b_rounded=True, **self.q8)}
        dg = core.grouped_matmul(dye, np.swapaxes(params["wo"], 1, 2), groups,
                                 name=f"{self.name}/d_hidden", a_rounded=True, b_rounded=True,
                                 **self.q8)
        du = self._activation_grad(core, dg, [cache[k] for k in self.dot_keys])
        dxd = None
        for w, d in zip(self.inputs, du, strict=True):
            dr = mxu_input(core, d)
            grads[w] = core.grouped_transposed_matmul(xd, dr, groups, name=f"{self.name}/d_{w}",
                                                      a_rounded=True, b_rounded=True, **self.q8)
            if need_dx:
                part = core.grouped_matmul(dr, np.swapaxes(params[w], 1, 2), groups,
                                           name=f"{self.name}/dx_{w}", a_rounded=True,
                                           b_rounded=True, **self.q8)
                dxd = part if dxd is None else add(core, f"{self.name}/dx_sum", dxd, part,
                                                   epilogue(self.fusion))
        dl = mxu_input(core, vector_op(
            core, f"{self.name}/route_bwd",
            lambda d, p, gt, ch: _router_grad(d, p, gt, ch, route["density"],
                                              self.aux_loss_weight),
            dgates, route["probs"], route["gates"], route["choice"],
            out=(route["probs"].shape, route["probs"].dtype), ops_per_element=6.0,
            fused=prologue(self.fusion)))
        grads["router"] = core.matmul(xr.T, dl, name=f"{self.name}/d_router", a_rounded=True,
                                      b_rounded=True)                    # (C, E)
        if not need_dx or dxd is None:
            return None, grads
        back = hooks.combine(f"{self.name}/dispatch_bwd", dxd, self.experts)   # (E R, C)
        if self.dense and not self.dense_dropless:
            dx = self._dense_dispatch_grad(core, back, route, dyr.shape[0])
        else:
            dx = vector_op(core, f"{self.name}/dispatch_bwd", _dispatch_grad, back,
                           route["slot"], out=((dyr.shape[0], c), back.dtype),
                           ops_per_element=float(self._combined))
        dxr = core.matmul(dl, params["router"].T, name=f"{self.name}/dx_router", a_rounded=True,
                          b_rounded=True)                                # (N, C)
        dx = add(core, f"{self.name}/dx_router_sum", dx, dxr, epilogue(self.fusion))
        return dx.reshape(*lead, c), grads

    # ------------------------------------------------------------ the dense dispatch

    def _mask_shape(self, route, t: int) -> tuple[int, int, int]:
        """(sequences b, T, E cap): the masks are (b, T, E cap)."""
        return route["sequences"], t, self.slots(t)

    def _dense_dispatch(self, core, xr, route, b: int, t: int):
        """The masks (a VPU op writing both, bf16) and einsum("BSM,BSEC->EBCM"): per
        sequence (E cap, T) x (T, C) on the MXU. Returns the (E R, C) rows."""
        _, _, slots = self._mask_shape(route, t)
        c = xr.shape[1]
        elements = b * t * slots
        core.account_vector(f"{self.name}/masks", elements, 2 * 2 * elements,
                            ops_per_element=2.0 * self.k)
        core.account_matmul(slots, t, c, batch=b, name=f"{self.name}/dispatch")
        if not core.execute:
            return timing_zeros((route["rows"], c), xr.dtype)
        return _dispatch(xr, route["slot"], route["rows"])               # the one-hot product

    def _combine_gates(self, core, route):
        """The gates as the combine mask holds them: bf16 under bf16 numerics."""
        return to_bf16(route["gates"]) if core.numerics else route["gates"]

    def _dense_combine(self, core, back, route, b: int, t: int):
        """einsum("EBCM,BSEC->BSM"): per sequence (T, E cap) x (E cap, C) on the MXU."""
        c = back.shape[1]
        core.account_matmul(t, self.slots(t), c, batch=b, name=f"{self.name}/combine")
        if not core.execute:
            return timing_zeros((b * t, c), back.dtype)
        return _combine(mxu_input(core, back), self._combine_gates(core, route), route["slot"])

    def _dense_combine_grad(self, core, dyr, rows, route):
        """The combine's operand gradients, two MXU products per sequence: the expert
        outputs' (E cap, T) x (T, C) and the combine mask's (T, C) x (C, E cap); then
        the gates' gradients read from the mask's (a VPU pass over it and the dispatch
        mask). Returns (d rows (E R, C), d gates (N, k))."""
        b, t, slots = self._mask_shape(route, dyr.shape[0] // route["sequences"])
        c = dyr.shape[1]
        core.account_matmul(slots, t, c, batch=b, name=f"{self.name}/combine_bwd")
        core.account_matmul(t, c, slots, batch=b, name=f"{self.name}/combine_bwd/d_mask")
        core.account_vector(f"{self.name}/combine_bwd/d_gates", b * t * slots,
                            2 * 2 * b * t * slots, ops_per_element=2.0)
        if not core.execute:
            return (timing_zeros(rows.shape, dyr.dtype),
                    timing_zeros(route["gates"].shape, route["gates"].dtype))
        dy = mxu_input(core, dyr)
        drows, dgates = _combine_grad(dy, mxu_input(core, rows), self._combine_gates(core, route),
                                      route["slot"])
        return drows, dgates.astype(route["gates"].dtype, copy=False)

    def _dense_dispatch_grad(self, core, back, route, n: int):
        """The dispatch's input gradient: per sequence (T, E cap) x (E cap, C)."""
        b, t, slots = self._mask_shape(route, n // route["sequences"])
        c = back.shape[1]
        core.account_matmul(t, slots, c, batch=b, name=f"{self.name}/dispatch_bwd")
        if not core.execute:
            return timing_zeros((n, c), back.dtype)
        return _dispatch_grad(mxu_input(core, back), route["slot"])

    def _activation_grad(self, core, dg, u):
        return activation_backward(core, self.name, self.activation, self.gated, self.fusion,
                                   dg, u)
