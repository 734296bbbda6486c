"""A toy SPMD device program through the DeviceCollectives protocol: a linear layer
y = x W, W (D, K) split by rows over fsdp and by columns over tensor, the batch over
data x fsdp, mean squared error, SGD. Exact float32 on the VPU (``core.vector``),
so its cost depends on shapes only and a numpy reference can check it."""

from __future__ import annotations

import numpy as np

from pod.programs import DeviceShard, StepResult

D, K, LR = 8, 4, 0.5


def full_init(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((D, K)).astype(np.float32)


class ToyProgram:
    """The device program API of ``pod.workloads.sharded.ShardedTransformer``:
    init_local(seed, coords) -> DeviceShard, train_step(...) -> StepResult,
    batch_slice, assemble."""

    def __init__(self, sizes):
        self.sizes = {a: int(sizes.get(a, 1)) for a in ("data", "fsdp", "tensor")}

    def init_local(self, seed, coords):
        f, t = coords.fsdp, coords.tensor
        nf, nt = self.sizes["fsdp"], self.sizes["tensor"]
        w = full_init(seed)
        return DeviceShard(coords, {"w": w[f * D // nf:(f + 1) * D // nf,
                                           t * K // nt:(t + 1) * K // nt].copy()}, {})

    def batch_slice(self, global_batch, coords):
        shards = self.sizes["data"] * self.sizes["fsdp"]
        per = global_batch // shards
        s = coords.data * self.sizes["fsdp"] + coords.fsdp
        return slice(s * per, (s + 1) * per)

    def assemble(self, shards, opt_state=False):
        w = np.empty((D, K), np.float32)
        nf, nt = self.sizes["fsdp"], self.sizes["tensor"]
        for shard in shards:
            f, t = shard.coords.fsdp, shard.coords.tensor
            w[f * D // nf:(f + 1) * D // nf, t * K // nt:(t + 1) * K // nt] = shard.params["w"]
        return {"w": w}

    def train_step(self, core, comm, shard, x, y, step):
        state = shard.params
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
        return StepResult(loss, DeviceShard(shard.coords, {"w": np.asarray(w, np.float32)}, {}),
                          update_start)


def reference(seed: int, batches) -> np.ndarray:
    """The same training on one device: the whole batch, numpy float32."""
    w = full_init(seed)
    for x, y in batches:
        err = x @ w - y
        w = w - np.float32(LR) * ((x.T @ err) * np.float32(2.0 / (x.shape[0] * K)))
    return w
