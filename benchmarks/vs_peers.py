"""This emulator against the tools users would otherwise run, measured side by side.

Usage (needs the optional extra: ``pip install -e '.[peers]'``, jax and torch CPU;
``--step-only``: jax alone):

    .venv/bin/python benchmarks/vs_peers.py [--steps 30] [--repeats 15] [--step-only]

Three comparisons, each in this one run, the variants alternated, medians of
wall seconds (never simulated time):

1. **step**: the quick start's data-parallel step (``scenarios/quickstart.yaml``:
   v2-8, 4 chip actors of 2 TensorCores, the seed CNN on digits, global batch
   256, Adam) against the same CNN, batch, optimizer and initial parameters in
   JAX over 8 fake CPU devices (``--xla_force_host_platform_device_count=8``,
   ``shard_map`` over a "data" axis, gradients ``pmean``-ed). Both take the
   same batches (``batch_indices``); the JAX step includes putting the batch
   on the devices, as the pod step includes sending each chip its shard.
   Dropout as the scenario's CNN (rates 0.3, 0.3, 0.5) in both, each with its
   own random streams. JAX compiles (twice: for the initial arrays and for its
   own outputs) before timing.
2. **allreduce**: the functional allreduce (``run_schedule``, chip to chip over
   ``pod/runtime/ici.py``) over 8 chip actors on a 2x4 torus, ring and torus
   schedules, against ``ray.util.collective``'s gloo backend (Ray 2.60 runs it
   on torch.distributed's gloo; pygloo is not used) among 8 actors, at the
   CNN's gradient size (its parameter count x 4 bytes, 176 kB) and at 16 MiB.
   Each side is timed from the driver around one call per actor, so both pay
   the same Ray call overhead. Every result is checked against numpy's sum.

Prints each ratio (emulator / peer: below 1 is faster) and the machine's load
average before and after, since other jobs on the machine move every figure; and
the CPU time of each side beside its wall time (the pod: its chip actors and this
driver; JAX: this process; an allreduce: its 8 actors), the fairer measure while
other jobs share the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib

# JAX reads the flag at import: 8 fake CPU devices. One intra-op thread per
# device keeps it from oversubscribing the cores beside the chip actors.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo over loopback (pitfalls.md)

import numpy as np  # noqa: E402
import ray  # noqa: E402
from _cpu import cpu_seconds  # noqa: E402  (benchmarks/, the script's folder)

from interconnect import Torus, build_collective  # noqa: E402
from pod.config.plan import batch_indices, build_plan  # noqa: E402
from pod.config.scenario import load_scenario  # noqa: E402
from pod.runtime.cluster import ensure_ray, shutdown_ray  # noqa: E402
from pod.runtime.collective import BufferActor, run_schedule, split_chunks  # noqa: E402
from pod.runtime.pod import Pod  # noqa: E402

QUICKSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scenarios",
                          "quickstart.yaml")
LARGE_BYTES = 16 << 20


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def actor_pids(actors) -> list[int]:
    return ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])


# -- 1. the step: the pod against JAX over 8 fake devices ------------------------

def jax_step_fn(plan):
    """A jitted shard_map step of the quick start's CNN with Adam, and its state.

    Returns (step(params, opt, x, y, key, t) -> (params, opt, loss), params, opt).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    training = plan.scenario.training
    options = training.optimizer.options()
    lr = float(options.get("learning_rate", 1e-3))
    b1, b2, eps = (float(options.get(k, d)) for k, d in
                   (("beta1", 0.9), ("beta2", 0.999), ("eps", 1e-7)))
    rates = {layer.name: layer.rate for layer in plan.model.layers if layer.kind == "dropout"}
    params = {k: jnp.asarray(v) for k, v in plan.model.init_params(training.seed).items()}
    opt = {"m": {k: jnp.zeros_like(v) for k, v in params.items()},
           "v": {k: jnp.zeros_like(v) for k, v in params.items()}}

    def conv(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y + b

    def pool(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def dropout(x, name, key):
        rate = rates.get(name, 0.0)
        if not rate:
            return x
        keep = jax.random.uniform(jax.random.fold_in(key, zlib.crc32(name.encode()) % 997),
                                  x.shape) >= rate
        return jnp.where(keep, x / (1.0 - rate), 0.0)

    def loss_fn(p, x, y, key):
        h = dropout(pool(jax.nn.relu(conv(x, p["conv1/kernel"], p["conv1/bias"]))), "dropout1", key)
        h = dropout(pool(jax.nn.relu(conv(h, p["conv2/kernel"], p["conv2/bias"]))), "dropout2", key)
        h = h.reshape(h.shape[0], -1)
        h = dropout(jax.nn.relu(h @ p["dense1/kernel"] + p["dense1/bias"]), "dropout3", key)
        logits = h @ p["dense2/kernel"] + p["dense2/bias"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def train_step(p, o, x, y, key, t):
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y, key)
        grads = jax.lax.pmean(grads, "data")
        m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, o["m"], grads)
        v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, o["v"], grads)
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        p = jax.tree.map(lambda p_, m_, v_: p_ - lr * (m_ / bc1) / (jnp.sqrt(v_ / bc2) + eps),
                         p, m, v)
        return p, {"m": m, "v": v}, jax.lax.pmean(loss, "data")

    mesh = jax.make_mesh((8,), ("data",))
    sharded = jax.shard_map(train_step, mesh=mesh,
                            in_specs=(P(), P(), P("data"), P("data"), P(), P()),
                            out_specs=(P(), P(), P()))
    data_sharding = jax.sharding.NamedSharding(mesh, P("data"))
    step = jax.jit(sharded, donate_argnums=(0, 1))

    def run(p, o, x, y, key, t):
        xs = jax.device_put(x, data_sharding)
        ys = jax.device_put(y, data_sharding)
        p, o, loss = step(p, o, xs, ys, key, jnp.float32(t))
        loss.block_until_ready()
        return p, o, float(loss)

    return run, params, opt


def compare_step(steps: int, settle_s: float = 0.0) -> tuple[float, float, dict]:
    """Median wall ms per step of the pod and of JAX, alternated step by step, each
    after ``settle_s`` of sleep (XLA's CPU worker threads spin for a while after a step
    and take the cores from whatever runs next); the info holds each side's mean CPU
    ms per step (``pod_cpu_ms``: the actors and the driver's main thread;
    ``jax_cpu_ms``: this process, every thread; ``other_threads_during_pod_cpu_ms``:
    this process's threads but the driver's during the pod's steps, Ray's client
    threads and whatever XLA's pool still spins after a JAX step)."""
    import jax

    plan = build_plan(load_scenario(QUICKSTART))
    data, seed = plan.dataset, plan.scenario.training.seed
    run, params, opt = jax_step_fn(plan)
    key = jax.random.key(seed)

    def batch(step):
        idx = batch_indices(data.x_train.shape[0], plan.global_batch, step, seed)
        return data.x_train[idx], data.y_train[idx].astype(np.int32)

    t0 = time.perf_counter()
    params, opt, _ = run(params, opt, *batch(0), key, 1)  # compile
    # and again: the step's outputs (sharded, donated) are not the initial arrays and
    # the second call compiles for them (it was inside the first timed step: its median
    # hid it, not the mean CPU)
    params, opt, _ = run(params, opt, *batch(0), key, 1)
    compile_s = time.perf_counter() - t0
    pod = Pod(plan)
    startup_s = pod.start()
    pod_ms, jax_ms, losses = [], [], {}
    pod_cpu = jax_cpu = residue = 0.0
    try:
        pod.step(0)  # warm-up (first calls, first links)
        pids = actor_pids(pod.actors)
        for step in range(1, steps + 1):
            time.sleep(settle_s)
            c0, t0 = cpu_seconds(pids) + time.thread_time(), time.perf_counter()
            o0 = time.process_time() - time.thread_time()
            stats = pod.step(step)
            pod_ms.append(time.perf_counter() - t0)
            pod_cpu += cpu_seconds(pids) + time.thread_time() - c0
            residue += time.process_time() - time.thread_time() - o0
            x, y = batch(step)
            time.sleep(settle_s)
            c0, t0 = time.process_time(), time.perf_counter()
            params, opt, loss = run(params, opt, x, y, key, step + 1)
            jax_ms.append(time.perf_counter() - t0)
            jax_cpu += time.process_time() - c0
            losses = {"pod": stats.loss, "jax": loss}
    finally:
        pod.shutdown()
    info = {"jax_compile_s": compile_s, "pod_startup_s": startup_s, "last_losses": losses,
            "pod_cpu_ms": pod_cpu / steps * 1e3, "jax_cpu_ms": jax_cpu / steps * 1e3,
            "other_threads_during_pod_cpu_ms": residue / steps * 1e3}
    return median_ms(pod_ms), median_ms(jax_ms), info


# -- 2. the allreduce: chip actors against ray.util.collective's gloo ------------

@ray.remote(num_cpus=0)
class GlooRank:
    """One rank of a ray.util.collective gloo group (torch.distributed's gloo)."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.tensor = None

    def set_buffer(self, values: np.ndarray) -> None:
        import torch

        self.tensor = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))

    def allreduce(self, group: str) -> None:
        from ray.util import collective

        collective.allreduce(self.tensor, group_name=group)

    def get_buffer(self) -> np.ndarray:
        return self.tensor.numpy().copy()


def compare_allreduce(num_bytes: int, repeats: int, chips, schedules, gloo, group: str,
                      piece_bytes: int | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall ms of each variant at one size, alternated, results checked; and the
    mean CPU ms of its 8 actors per allreduce.

    The emulator's schedules run as the pod runs them: large chunks cut into
    pieces (``split_chunks``), the chips' link addresses looked up once (as
    the gloo group is set up once)."""
    count = num_bytes // 4
    rng = np.random.default_rng(count)
    buffers = [rng.integers(-8, 8, count).astype(np.float32) for _ in chips]
    total = np.sum(np.stack(buffers), axis=0)
    addresses = ray.get([a.ici_address.remote(b"") for a in chips])
    piece = {} if piece_bytes is None else {"max_chunk_bytes": piece_bytes}
    built = {name: split_chunks(build_collective("allreduce", TORUS, count, 4, name), **piece)
             for name in schedules}
    times: dict[str, list[float]] = {name: [] for name in [*built, "gloo"]}
    cpu = dict.fromkeys(times, 0.0)
    pids = {"chips": actor_pids(chips), "gloo": actor_pids(gloo)}
    for _ in range(repeats):
        for name in times:
            actors = gloo if name == "gloo" else chips
            if name != "gloo":
                ray.get([a.set_chunk_bounds.remote(built[name].chunk_bounds) for a in chips])
            ray.get([a.set_buffer.remote(b) for a, b in zip(actors, buffers, strict=True)])
            procs = pids["gloo" if name == "gloo" else "chips"]
            c0, t0 = cpu_seconds(procs), time.perf_counter()
            if name == "gloo":
                ray.get([a.allreduce.remote(group) for a in gloo])
            else:
                ray.get(run_schedule(chips, built[name], addresses=addresses))
            times[name].append(time.perf_counter() - t0)
            cpu[name] += cpu_seconds(procs) - c0
            got = ray.get(actors[-1].get_buffer.remote())
            if not np.array_equal(got, total):
                raise AssertionError(f"{name}: the allreduce result differs from numpy's sum")
    return ({name: median_ms(values) for name, values in times.items()},
            {name: total / repeats * 1e3 for name, total in cpu.items()})


TORUS = Torus((2, 4), True)


def allreduce_actors():
    """8 chip actors (``BufferActor``, as benchmarks/functional_allreduce.py) and 8 gloo
    ranks."""
    from ray.util import collective

    remote = ray.remote(BufferActor).options(num_cpus=0)
    chips = [remote.remote(r) for r in range(TORUS.num_chips)]
    gloo = [GlooRank.remote() for _ in range(TORUS.num_chips)]
    group = "vs-peers"
    collective.create_collective_group(gloo, len(gloo), list(range(len(gloo))), backend="gloo",
                                       group_name=group)
    ray.get([a.node_id.remote() for a in chips])
    return chips, gloo, group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each (after warm-up)")
    parser.add_argument("--repeats", type=int, default=15,
                        help="allreduces of each variant per size")
    parser.add_argument("--algorithms", default="ring,torus")
    parser.add_argument("--settle-ms", type=float, default=0.0,
                        help="sleep before each timed step of either side (XLA's threads spin "
                             "after a JAX step; 0: alternate back to back, as before)")
    parser.add_argument("--step-only", action="store_true",
                        help="the step comparison alone (no torch needed)")
    args = parser.parse_args()
    import jax

    started = ensure_ray(None)
    print(f"load average at the start: {loadavg()} ({os.cpu_count()} cores); "
          f"jax {jax.__version__} on {jax.device_count()} {jax.devices()[0].platform} devices")
    try:
        pod_ms, jax_ms, info = compare_step(args.steps, args.settle_ms / 1e3)
        print(f"step (quick start, wall, median of {args.steps}, {args.settle_ms:g} ms settle "
              f"before each): pod {pod_ms:.1f} ms, "
              f"JAX shard_map {jax_ms:.1f} ms (compile {info['jax_compile_s']:.1f} s; "
              f"pod start-up {info['pod_startup_s']:.1f} s; last losses {info['last_losses']})")
        print(f"  CPU per step (mean): pod {info['pod_cpu_ms']:.1f} ms (4 chip actors and the "
              f"driver's thread), JAX {info['jax_cpu_ms']:.1f} ms (this process); this "
              f"process's other threads (Ray's and XLA's) during the pod's steps "
              f"{info['other_threads_during_pod_cpu_ms']:.1f} ms")
        if args.step_only:
            print(f"ratio, data-parallel step vs JAX: {pod_ms / jax_ms:.2f}x (goal: at most "
                  f"1.5x; CPU {info['pod_cpu_ms'] / info['jax_cpu_ms']:.2f}x)")
            print(f"load average at the end: {loadavg()}")
            return
        chips, gloo, group = allreduce_actors()
        plan = build_plan(load_scenario(QUICKSTART))
        sizes = {f"CNN gradients ({plan.num_params * 4 / 1e3:.0f} kB)": plan.num_params * 4,
                 "16 MiB": LARGE_BYTES}
        schedules = [a for a in args.algorithms.split(",") if a]
        results, cpus = {}, {}
        for label, nbytes in sizes.items():
            results[label], cpus[label] = compare_allreduce(nbytes, args.repeats, chips, schedules,
                                                            gloo, group)
            print(f"allreduce {label} over 8 actors (wall, median of {args.repeats}): "
                  + ", ".join(f"{k} {v:.1f} ms" for k, v in results[label].items())
                  + "; CPU of the 8 actors (mean): "
                  + ", ".join(f"{k} {v:.1f} ms" for k, v in cpus[label].items()), flush=True)
        print("\nratios (emulator / peer, wall; below 1 = the emulator is faster):")
        print(f"  data-parallel step vs JAX:          {pod_ms / jax_ms:.2f}x  "
              f"(goal: at most 1.5x; CPU {info['pod_cpu_ms'] / info['jax_cpu_ms']:.2f}x)")
        for label, res in results.items():
            for name in schedules:
                print(f"  allreduce {label}, {name:5s} vs gloo: {res[name] / res['gloo']:.2f}x  "
                      f"(goal: below 1; CPU {cpus[label][name] / cpus[label]['gloo']:.2f}x)")
        print(f"load average at the end: {loadavg()}")
    finally:
        if started:
            shutdown_ray()


if __name__ == "__main__":
    main()
