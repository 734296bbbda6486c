"""A toy SPMD device program through the DeviceCollectives protocol: a linear layer
y = x W, W (D, K) split by rows over fsdp and by columns over tensor, the batch over
data x fsdp, mean squared error, SGD. Exact float32 on the VPU (``core.vector``),
so its cost depends on shapes only and a numpy reference can check it."""

from __future__ import annotations

import numpy as np

D, K, LR = 8, 4, 0.5


def full_init(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((D, K)).astype(np.float32)


class ToyProgram:
    def init_local(self, groups, seed):
        f, t = groups.ring_index("fsdp"), groups.ring_index("tensor")
        nf, nt = groups.axis_size("fsdp"), groups.axis_size("tensor")
        w = full_init(seed)
        return {"w": w[f * D // nf:(f + 1) * D // nf, t * K // nt:(t + 1) * K // nt].copy()}

    def train_step(self, core, comm, state, x, y, step, seed):
        nt = comm.axis_size("tensor")
        t = comm.axis_index("tensor")
        n_global = x.shape[0] * comm.axis_size("data") * comm.axis_size("fsdp")
        kb = K // nt

        def at():
            return len(core.records)

        w_cols = comm.all_gather("fsdp", state["w"].reshape(-1), tag="w", kind="param_gather",
                                 after_record=at()).reshape(D, kb)
        out = core.vector("toy/forward", np.matmul, x, w_cols)  # (B, K/nt)
        pred = comm.all_gather("tensor", np.ascontiguousarray(out.T).reshape(-1), tag="out",
                               kind="activation", after_record=at()).reshape(K, -1).T  # (B, K)
        err = core.vector("toy/error", np.subtract, pred, y)
        loss = float(np.mean(err * err))
        scale = np.float32(2.0 / (n_global * K))
        mine = np.ascontiguousarray(err[:, t * kb:(t + 1) * kb])
        g = core.vector("toy/grad", lambda a, b: (a.T @ b) * scale, x, mine)  # (D, K/nt)
        g = comm.reduce_scatter("fsdp", np.ascontiguousarray(g).reshape(-1).astype(np.float32),
                                tag="g", kind="grad_reduce", after_record=at())
        g = comm.allreduce("data", g, tag="g", kind="grad_reduce", after_record=at())
        update_start = at()
        w = core.vector("opt/sgd", lambda a, b: a - np.float32(LR) * b, state["w"],
                        g.reshape(state["w"].shape))
        return loss, {"w": np.asarray(w, np.float32)}, update_start

    def local_params(self, state):
        return state


def assemble(local: list[dict], mesh) -> np.ndarray:
    """The full W from every device's shard."""
    from pod.config.sharding import device_groups

    w = np.empty((D, K), np.float32)
    for d, params in enumerate(local):
        g = device_groups(mesh, d)
        f, t = g.ring_index("fsdp"), g.ring_index("tensor")
        nf, nt = g.axis_size("fsdp"), g.axis_size("tensor")
        w[f * D // nf:(f + 1) * D // nf, t * K // nt:(t + 1) * K // nt] = params["w"]
    return w


def reference(seed: int, batches) -> np.ndarray:
    """The same training on one device: the whole batch, numpy float32."""
    w = full_init(seed)
    for x, y in batches:
        err = x @ w - y
        w = w - np.float32(LR) * ((x.T @ err) * np.float32(2.0 / (x.shape[0] * K)))
    return w
