"""A toy SPMD device program through the DeviceCollectives protocol: a linear layer
y = x W, W (D, K) split by rows over fsdp and by columns over tensor, the batch over
data x fsdp, mean squared error, SGD. Exact float32 on the VPU (``core.vector``),
so its cost depends on shapes only and a numpy reference can check it.

It implements the whole ``pod.programs.DeviceProgram`` contract, so the runtime's
pods run it as they run the real programs (``ToyLocalPod``, ``ToyRayPod``)."""

from __future__ import annotations

import numpy as np

from pod.programs import DeviceMemory, DeviceShard, EvalSums, StepResult

D, K, LR = 8, 4, 0.5
SEED, STEPS, BATCH = 3, 4, 16


def full_init(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((D, K)).astype(np.float32)


def batches(steps: int = STEPS, batch: int = BATCH) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each step's (x (B, D), y (B, K)) of a noiseless linear target."""
    rng = np.random.default_rng(9)
    truth = rng.standard_normal((D, K)).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((batch, D)).astype(np.float32)
        out.append((x, (x @ truth).astype(np.float32)))
    return out


class ToyProgram:
    """The device program contract (``pod.programs.contract.DeviceProgram``) for the toy
    linear layer."""

    def __init__(self, sizes):
        self.sizes = {a: int(sizes.get(a, 1)) for a in ("data", "fsdp", "tensor")}

    @property
    def batch_shards(self) -> int:
        return self.sizes["data"] * self.sizes["fsdp"]

    def _block(self, coords):
        f, t = coords.fsdp, coords.tensor
        nf, nt = self.sizes["fsdp"], self.sizes["tensor"]
        return slice(f * D // nf, (f + 1) * D // nf), slice(t * K // nt, (t + 1) * K // nt)

    def init_local(self, seed, coords):
        return DeviceShard(coords, {"w": full_init(seed)[self._block(coords)].copy()}, {})

    def shape_shard(self, coords):
        rows, cols = self._block(coords)
        zeros = np.zeros((rows.stop - rows.start, cols.stop - cols.start), np.float32)
        zeros.flags.writeable = False
        return DeviceShard(coords, {"w": zeros}, {})

    def load_local(self, params, opt_state, coords, model_state=None):
        return DeviceShard(coords, {"w": np.array(params["w"][self._block(coords)],
                                                   dtype=np.float32)}, {})

    def assemble(self, shards, opt_state=False):
        if opt_state:
            return {}
        w = np.empty((D, K), np.float32)
        for shard in shards:
            w[self._block(shard.coords)] = shard.params["w"]
        return {"w": w}

    def batch_slice(self, global_batch, coords):
        per = global_batch // self.batch_shards
        s = coords.data * self.sizes["fsdp"] + coords.fsdp
        return slice(s * per, (s + 1) * per)

    def eval_slice(self, num_examples, coords):
        return self.batch_slice(num_examples, coords)

    def counts_eval(self, coords):
        return coords.tensor == 0

    def memory(self, per_device_batch, precision="bf16", *, prefetch_layers=1):
        """Its float32 block of W (D / fsdp, K / tensor) and that block's gradient, SGD's
        empty state, and the (B, K / tensor) output of ``per_device_batch`` examples."""
        w = 4 * (D // self.sizes["fsdp"]) * (K // self.sizes["tensor"])
        return DeviceMemory(w, w, 0, 4 * int(per_device_batch) * K // self.sizes["tensor"])

    def _forward(self, core, comm, w, x):
        def at():
            return len(core.records)

        kb = K // comm.axis_size("tensor")
        w_cols = comm.all_gather("fsdp", np.ascontiguousarray(w).reshape(-1), tag="w",
                                 kind="param_gather", after_record=at()).reshape(D, kb)
        out = core.vector("toy/forward", np.matmul, x, w_cols)  # (B, K/nt)
        return comm.all_gather("tensor", np.ascontiguousarray(out.T).reshape(-1), tag="out",
                               kind="activation", after_record=at()).reshape(K, -1).T  # (B, K)

    def evaluate(self, core, comm, shard, x, y):
        err = self._forward(core, comm, shard.params["w"], x) - y
        return EvalSums(float(np.sum(err * err)), 0, int(err.size))

    def train_step(self, core, comm, shard, x, y, step, *, rng=None):
        def at():
            return len(core.records)

        nt = comm.axis_size("tensor")
        t = comm.axis_index("tensor")
        n_global = x.shape[0] * comm.axis_size("data") * comm.axis_size("fsdp")
        kb = K // nt
        pred = self._forward(core, comm, shard.params["w"], x)
        err = core.vector("toy/error", np.subtract, pred, y)
        loss = float(np.mean(err * err))
        scale = np.float32(2.0 / (n_global * K))
        mine = np.ascontiguousarray(err[:, t * kb:(t + 1) * kb])
        g = core.vector("toy/grad", lambda a, b: (a.T @ b) * scale, x, mine)  # (D, K/nt)
        g = comm.reduce_scatter("fsdp", np.ascontiguousarray(g).reshape(-1).astype(np.float32),
                                tag="g", kind="grad_reduce", after_record=at())
        g = comm.allreduce("data", g, tag="g", kind="grad_reduce", after_record=at())
        update_start = at()
        w = shard.params["w"]
        w = core.vector("opt/sgd", lambda a, b: a - np.float32(LR) * b, w, g.reshape(w.shape))
        return StepResult(loss, DeviceShard(shard.coords, {"w": np.asarray(w, np.float32)}, {}),
                          update_start)


def reference(seed: int, steps) -> np.ndarray:
    """The same training on one device: the whole batch, numpy float32."""
    w = full_init(seed)
    for x, y in steps:
        err = x @ w - y
        w = w - np.float32(LR) * ((x.T @ err) * np.float32(2.0 / (x.shape[0] * K)))
    return w
