"""Token embedding and the LSTM, with full backpropagation through time.

Layouts follow ``tf.keras``: an LSTM's ``kernel`` is (D, 4H),
``recurrent_kernel`` (H, 4H) and ``bias`` (4H,), gates in the order input,
forget, cell candidate, output; the forget gate's bias starts at 1
(``unit_forget_bias``), the recurrent kernel is orthogonal, the input kernel
Glorot-uniform. Embeddings start U(-0.05, 0.05).
"""

from __future__ import annotations

import math

import numpy as np

from pod.workloads.checks import check_int, check_token_ids
from pod.workloads.layers import Layer, glorot_uniform, mxu_input, sigmoid


class Embedding(Layer):
    """Token ids (B, *S) -> vectors (B, *S, D) by table lookup.

    The lookup is a gather (costed on the vector unit: the rows read and
    written); the gradient of the table is a scatter-add of the output
    gradient into a dense (V, D) array. Integer inputs have no gradient.

    Args:
        input_dim: vocabulary size V; ids must be in [0, V).
        output_dim: vector size D.
        name: layer name.

    Raises:
        ValueError: non-positive sizes; at run time, an id outside [0, V).
    """

    kind = "embedding"

    def __init__(self, input_dim: int, output_dim: int, name: str | None = None):
        super().__init__(name)
        for field, value in (("input_dim", input_dim), ("output_dim", output_dim)):
            check_int(value, f"Embedding {field}")
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)

    def param_shapes(self, input_shape):
        return {"embeddings": (self.input_dim, self.output_dim)}

    def init_params(self, rng, input_shape):
        shape = (self.input_dim, self.output_dim)
        return {"embeddings": rng.uniform(-0.05, 0.05, size=shape).astype(np.float32)}

    def output_shape(self, input_shape):
        return (*tuple(input_shape), self.output_dim)

    def cache_elements(self, input_shape):
        return math.prod(input_shape)  # the ids

    def _ids(self, x) -> np.ndarray:
        return check_token_ids(x, self.input_dim, self.name)

    def check_inputs(self, x) -> None:
        self._ids(x)

    def forward(self, core, params, x, *, training=False, rng=None):
        ids = self._ids(x)                                                # (B, *S)
        table = params["embeddings"]                                      # (V, D)
        y = core.vector(f"{self.name}/gather", lambda i: table[i], ids)   # (B, *S, D)
        return y, ids

    def backward(self, core, params, cache, dy, *, need_dx=True):
        ids = cache

        def scatter(d):
            dtable = np.zeros((self.input_dim, self.output_dim), d.dtype)  # (V, D)
            np.add.at(dtable, ids.reshape(-1), d.reshape(-1, self.output_dim))
            return dtable

        return None, {"embeddings": core.vector(f"{self.name}/scatter_add", scatter, dy)}


def orthogonal(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Orthogonal init (Saxe et al.; Keras ``Orthogonal``): QR of a Gaussian
    matrix, signs fixed by the diagonal of R. float32."""
    rows, cols = shape
    a = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q = q * np.sign(np.diag(r))
    q = q if rows >= cols else q.T
    return np.ascontiguousarray(q[:rows, :cols], dtype=np.float32)


class LSTM(Layer):
    """Long short-term memory over (B, T, D) inputs, zero initial state.

    Per step t, with z = x_t W + h_{t-1} U + b split into (i, f, g, o):
    i, f, o = sigmoid(.), g = tanh(.), c_t = f c_{t-1} + i g,
    h_t = o tanh(c_t). The input projection of all T steps is one GEMM
    (B*T, D) x (D, 4H); the recurrent product is one (B, H) x (H, 4H) GEMM
    per step, as on a TPU. Backward is full backpropagation through time;
    the weight gradients of all steps are again one GEMM each.

    Args:
        units: H, the state size.
        return_sequences: output every step (B, T, H) instead of the last (B, H).
        name: layer name.
    """

    kind = "lstm"
    matmul_params = ("kernel", "recurrent_kernel")

    def __init__(self, units: int, *, return_sequences: bool = False, name: str | None = None):
        super().__init__(name)
        self.units = check_int(units, "LSTM units")
        self.return_sequences = bool(return_sequences)

    def _check(self, input_shape) -> tuple[int, int]:
        if len(input_shape) != 2:
            raise ValueError(f"{self.name}: LSTM expects (steps, features) inputs, "
                             f"got {tuple(input_shape)}")
        return int(input_shape[0]), int(input_shape[1])

    def param_shapes(self, input_shape):
        _, d = self._check(input_shape)
        h = self.units
        return {"kernel": (d, 4 * h), "recurrent_kernel": (h, 4 * h), "bias": (4 * h,)}

    def init_params(self, rng, input_shape):
        _, d = self._check(input_shape)
        h = self.units
        bias = np.zeros(4 * h, np.float32)
        bias[h:2 * h] = 1.0                                              # unit_forget_bias
        return {"kernel": glorot_uniform(rng, (d, 4 * h), d, 4 * h),
                "recurrent_kernel": orthogonal(rng, (h, 4 * h)),
                "bias": bias}

    def output_shape(self, input_shape):
        t, _ = self._check(input_shape)
        return (t, self.units) if self.return_sequences else (self.units,)

    def forward_flops(self, input_shape):
        t, d = self._check(input_shape)
        return 2 * t * (d + self.units) * 4 * self.units

    def cache_elements(self, input_shape):
        t, d = self._check(input_shape)
        return t * (d + 8 * self.units)  # inputs; h_prev, c_prev, i, f, g, o, tanh(c), dz

    def step(self, core, params, zx_t, h, c):
        """One time step from its input projection zx_t = x_t W + b (B, 4H).

        Returns (h, c, (h_prev_rounded, gates, tanh_c)): the new state and
        what backward needs. ``params`` must hold MXU-ready (bf16-rounded
        when numerics) weights, as ``Model.prepare_params`` gives.
        """
        hh = self.units
        hr = mxu_input(core, h)                                           # (B, H)
        z = core.matmul(hr, params["recurrent_kernel"], name=f"{self.name}/fwd_recurrent",
                        a_rounded=True, b_rounded=True)                   # (B, 4H)

        def cell(z_, zx_, c_):
            z_ = z_ + zx_
            i, f = sigmoid(z_[:, :hh]), sigmoid(z_[:, hh:2 * hh])
            g, o = np.tanh(z_[:, 2 * hh:3 * hh]), sigmoid(z_[:, 3 * hh:])
            c_new = f * c_ + i * g
            tc = np.tanh(c_new)
            return i, f, g, o, c_new, tc, o * tc

        i, f, g, o, c_new, tc, h_new = core.vector(f"{self.name}/cell", cell, z, zx_t, c,
                                                   ops_per_element=4.0, transcendental=True)
        return h_new, c_new, (hr, (i, f, g, o), tc)

    def forward(self, core, params, x, *, training=False, rng=None):
        b, t, d = x.shape
        hh = self.units
        xr = mxu_input(core, x).reshape(b * t, d)                         # (B*T, D)
        zx = core.matmul(xr, params["kernel"], name=f"{self.name}/fwd_input",
                         a_rounded=True, b_rounded=True)                  # (B*T, 4H)
        zx = core.vector(f"{self.name}/bias_add", np.add, zx, params["bias"]).reshape(b, t, 4 * hh)
        h = np.zeros((b, hh), zx.dtype)
        c = np.zeros((b, hh), zx.dtype)
        hs = np.empty((b, t, hh), zx.dtype)                               # h_t, (B, T, H)
        h_prev = np.empty((t, b, hh), zx.dtype)                           # rounded h_{t-1}
        c_prev = np.empty((t, b, hh), zx.dtype)
        gates = np.empty((t, 4, b, hh), zx.dtype)                         # i, f, g, o
        tanh_c = np.empty((t, b, hh), zx.dtype)
        for s in range(t):
            c_prev[s] = c
            h, c, (hr, gs, tc) = self.step(core, params, zx[:, s], h, c)
            h_prev[s] = hr
            gates[s] = gs
            tanh_c[s] = tc
            hs[:, s] = h
        y = hs if self.return_sequences else h
        return y, (xr, h_prev, c_prev, gates, tanh_c, (b, t, d))

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xr, h_prev, c_prev, gates, tanh_c, (b, t, d) = cache
        hh = self.units
        dt = dy.dtype
        u_t = params["recurrent_kernel"].T                                # (4H, H)
        dz = np.empty((b, t, 4 * hh), dt)                                 # (B, T, 4H)
        dh_next = np.zeros((b, hh), dt)
        dc_next = np.zeros((b, hh), dt)
        one = np.asarray(1.0, dt)
        for s in range(t - 1, -1, -1):
            # a sequence's gradient at every step, else the last output's at the last step
            dh_out = dy[:, s] if self.return_sequences else (dy if s == t - 1 else None)

            def cell_back(dh_n, dc_n, i, f, g, o, tc, cp, dh_o=dh_out):
                dh = dh_n if dh_o is None else dh_n + dh_o
                dc = dc_n + dh * o * (one - tc * tc)
                return (np.concatenate([dc * g * i * (one - i),           # d z_i
                                        dc * cp * f * (one - f),          # d z_f
                                        dc * i * (one - g * g),           # d z_g
                                        dh * tc * o * (one - o)],         # d z_o
                                       axis=1),
                        dc * f)                                           # d c_{t-1}

            i, f, g, o = gates[s]
            dz_s, dc_next = core.vector(f"{self.name}/cell_bwd", cell_back, dh_next, dc_next,
                                        i, f, g, o, tanh_c[s], c_prev[s], ops_per_element=4.0)
            dz[:, s] = dz_s
            if s > 0:
                dh_next = core.matmul(mxu_input(core, dz_s), u_t, name=f"{self.name}/dh_recurrent",
                                      a_rounded=True, b_rounded=True)     # (B, H)
        dz2 = mxu_input(core, dz.reshape(b * t, 4 * hh))                  # (B*T, 4H)
        hp = h_prev.transpose(1, 0, 2).reshape(b * t, hh)                 # (B*T, H), rounded
        d_kernel = core.matmul(xr.T, dz2, name=f"{self.name}/dW",
                               a_rounded=True, b_rounded=True)            # (D, 4H)
        d_recurrent = core.matmul(hp.T, dz2, name=f"{self.name}/dU",
                                  a_rounded=True, b_rounded=True)         # (H, 4H)
        d_bias = core.vector(f"{self.name}/bias_grad", lambda v: v.sum(axis=0),
                             dz.reshape(b * t, 4 * hh))                   # (4H,)
        dx = None
        if need_dx:
            dx = core.matmul(dz2, params["kernel"].T, name=f"{self.name}/dx",
                             a_rounded=True, b_rounded=True).reshape(b, t, d)
        return dx, {"kernel": d_kernel, "recurrent_kernel": d_recurrent, "bias": d_bias}
