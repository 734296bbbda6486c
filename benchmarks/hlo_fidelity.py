"""The HLO path beside the project's own predictions (VALIDATION.md, "The HLO path").

(a) ``--single-op``: the shapes of the calibration rows C1-C14 (benchmarks/fidelity.py)
    written as JAX functions, compiled for a TPU with no TPU attached (libtpu; ``--path
    cpu`` over fake CPU devices instead), their HLO costed by ``pod.hlo`` on the row's
    chips, beside the project's single-op prediction of the same row (``fidelity.py``'s
    ``predict``, host dispatch left out of both: the HLO is the device's work).
(b) ``--training``: the calibration training rows T1-T4 (any row the oracle compiled) as
    the oracle's JAX transformer compiled for their slices (tools/xla_oracle), costed by
    the HLO path, beside the built-in path (the row's scenario, timing-only) and the
    published figure, with a per-op diff of where the two paths differ.
(c) ``--memory``: the HLO path's memory beside XLA's own buffer assignment.

Every time is SIMULATED, except the compile times (wall).

Usage::

    python benchmarks/hlo_fidelity.py --single-op [--markdown] [--path tpu|cpu]
    python benchmarks/hlo_fidelity.py --training [--memory] [--rows T1,T2,T3,T4] [--hlo-dir DIR]
    python benchmarks/hlo_fidelity.py --rows T1,T2,T3,T4 --compile-maxtext-flags DIR  # then
    python benchmarks/hlo_fidelity.py --training --memory --rows T1,T2,T3,T4 --hlo-dir DIR/hlo
    python benchmarks/hlo_fidelity.py --rows T1,T2 --compile-xla-defaults DIR  # XLA's defaults
    python benchmarks/hlo_fidelity.py --training --rows T2 --exposed-ops 12 \
        --hlo-dir tools/xla_oracle/hlo-maxtext   # MaxText's own step (maxtext_step.py)

The oracle's committed HLO (tools/xla_oracle/hlo) of T1-T4, M1 and M2 is compiled with their
runs' flags (``xla_flags: maxtext-2023``), the other rows' with XLA's defaults. MaxText's own
step (tools/xla_oracle/hlo-maxtext, ``python -m tools.xla_oracle.maxtext_step``) keeps a
``<row>.json`` beside each HLO (its mesh axes, device order and XLA's memory), read first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from tools.xla_oracle.flags import (  # noqa: E402
    MAXTEXT_2023_LIBTPU_ARGS,
    MAXTEXT_HOST_OFFLOAD_LIBTPU_ARGS,
)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class OpRow:
    """One single-op row as a JAX function.

    Attributes:
        id: the calibration row (C1..C14).
        compile_chip, compile_shape: the TPU topology the function is compiled for.
        cost_chip, cost_shape, wraparound: the chips the HLO is costed on (the row's).
        mesh: axis sizes of the function's mesh.
        build: (jax, mesh) -> (function, args, in_specs).
    """

    id: str
    compile_chip: str
    compile_shape: tuple[int, ...]
    cost_chip: str
    cost_shape: tuple[int, ...]
    wraparound: bool
    mesh: dict[str, int]
    build: Any


def _matmul(n: int):
    def build(jax, mesh):
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        s = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
        return (lambda a, b: a @ b), (s, s), (P(), P())
    return build


def _copy(jax, mesh):
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    return (lambda a: a.copy()), (jax.ShapeDtypeStruct((8 * MIB,), jnp.float32),), (P(),)


def _collective(kind: str, per_device: tuple[int, ...], dtype: str, axis: str = "i"):
    """A shard_map'ed collective over mesh axis ``axis`` of a per-device block."""
    def build(jax, mesh):
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        n = mesh.shape[axis]
        rest = tuple(a for a in mesh.axis_names if a != axis)

        def body(x):
            if kind == "all_gather":
                return jax.lax.all_gather(x, axis, tiled=True)
            if kind == "all_gather_as_psum":  # torch_xla's _all_gather_using_all_reduce
                full = jnp.zeros((x.shape[0] * n, *x.shape[1:]), x.dtype)
                full = jax.lax.dynamic_update_slice_in_dim(
                    full, x, jax.lax.axis_index(axis) * x.shape[0], 0)
                return jax.lax.psum(full, axis)
            if kind == "psum":
                return jax.lax.psum(x, axis)
            if kind == "psum_scatter":
                return jax.lax.psum_scatter(x, axis, scatter_dimension=x.ndim - 1, tiled=True)
            return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])

        spec = P((*rest, axis)) if kind != "all_gather" else P((*rest, axis))
        out = P(rest or None) if kind in ("all_gather", "psum", "all_gather_as_psum") else spec
        fn = jax.shard_map(body, in_specs=spec, out_specs=out, check_vma=False)
        total = (per_device[0] * mesh.size,) + per_device[1:]
        return fn, (jax.ShapeDtypeStruct(total, getattr(jnp, dtype)),), (spec,)
    return build


def single_op_rows() -> list[OpRow]:
    """C1-C14 as JAX functions (C6's 2 devices are v2 TensorCores: see VALIDATION.md; C8 and C10
    as torch_xla runs their all_gather, an allreduce of the zero-padded gathered buffer)."""
    return [
        OpRow("C1", "v5e", (1, 1), "v5e", (1, 1), False, {"one": 1}, _matmul(8192)),
        OpRow("C2", "v5e", (1, 1), "v5e", (1, 1), False, {"one": 1}, _matmul(4096)),
        OpRow("C3", "v5e", (1, 1), "v5e", (1, 1), False, {"one": 1}, _matmul(1024)),
        OpRow("C4", "v5e", (1, 1), "v5e", (1, 1), False, {"one": 1}, _matmul(32768)),
        OpRow("C5", "v6e", (1, 1), "v6e", (1, 1), False, {"one": 1}, _copy),
        OpRow("C7", "v5e", (2, 2), "v5e", (4,), False, {"i": 4},
              _collective("all_gather", (128 * KIB // 2 // 4,), "bfloat16")),
        OpRow("C8", "v5e", (2, 4), "v5e", (2, 4), False, {"i": 8},
              _collective("all_gather_as_psum", (32768 // 8, 32768), "bfloat16")),
        OpRow("C9", "v5e", (2, 4), "v5e", (2, 4), False, {"i": 8},
              _collective("psum", (128 * MIB,), "int8")),
        OpRow("C10", "v5e", (2, 4), "v5e", (2, 4), False, {"i": 8},
              _collective("all_gather_as_psum", (GIB // 8,), "int8")),
        OpRow("C11", "v5p", (2, 2, 1), "v5p", (2, 2, 1), False, {"j": 2, "i": 2},
              _collective("ppermute", (32 * MIB,), "bfloat16")),
        OpRow("C12", "v5p", (2, 2, 1), "v5p", (2, 2, 1), False, {"j": 2, "i": 2},
              _collective("ppermute", (MIB // 2,), "bfloat16")),
        OpRow("C13", "v5p", (2, 2, 1), "v5p", (2, 2, 1), False, {"j": 2, "i": 2},
              _collective("ppermute", (4 * KIB,), "bfloat16")),
        OpRow("C14", "v6e", (2, 4), "v6e", (2, 4), False, {"j": 4, "i": 2},
              _collective("ppermute", (1,), "bfloat16")),
    ]


@dataclass(frozen=True)
class OpResult:
    """A row: the prediction, the HLO path's cost of the row's own op (the collective, or
    the kernel), its difference, the whole module's step and what else it runs."""

    id: str
    setup: str
    predicted_s: float
    hlo_op_s: float
    diff_pct: float
    module_s: float
    others: str
    how: str
    compile_wall_s: float


def _predicted_device_seconds(row_id: str) -> tuple[float, str]:
    """fidelity.py's prediction of the row, host dispatch left out."""
    import fidelity

    from chip.calibration import HOST_DISPATCH_SECONDS

    ic = fidelity._import_interconnect(None)
    row = next(r for r in fidelity.rows() if r.id == row_id)

    def link_for(generation: str):
        return ic.calibrated_link(generation, fidelity.LINK_BYTES_PER_S[generation],
                                  fidelity.HOP_LATENCY_S)

    seconds, _ = fidelity.predict(row, ic, link_for)
    host = HOST_DISPATCH_SECONDS if row.timing == "host" else 0.0
    return seconds - host, row.setup


def _capture_row(row: OpRow, path: str, capture: Any) -> Any:
    """Compile the row's function (built over the capture's mesh)."""
    import math

    from pod.frontends.jax_capture import _jax

    jax = _jax(path, math.prod(row.compile_shape))
    holder: dict[str, Any] = {}

    def args(mesh):
        from jax.sharding import NamedSharding

        holder["fn"], arrays, specs = row.build(jax, mesh)
        return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, p))
                     for a, p in zip(arrays, specs, strict=True))

    def fn(*xs):
        return holder["fn"](*xs)

    fn.__name__ = row.id
    return capture(fn, args, mesh_axes=row.mesh, chip_name=row.compile_chip,
                   torus_shape=row.compile_shape,
                   slice_label=f"{row.compile_chip}:{'x'.join(map(str, row.compile_shape))}",
                   path=path)


def run_single_op(path: str) -> list[OpResult]:
    from pod.config.slices import resolve_pod
    from pod.frontends import capture
    from pod.hlo import cost_module, parse_hlo

    out = []
    for row in single_op_rows():
        captured = _capture_row(row, path, capture)
        topology = resolve_pod(chip=row.cost_chip, topology="x".join(map(str, row.cost_shape)),
                               wraparound=row.wraparound)
        module = parse_hlo(captured.hlo_text)
        step = cost_module(module, topology, approximate=captured.platform != "tpu",
                           sustained=False)
        predicted, setup = _predicted_device_seconds(row.id)
        if step.collectives:  # the row's op is its collective; the rest are the module's
            own = sum(c.seconds for c in step.collectives)
            how = ", ".join(sorted({c.algorithm for c in step.collectives}))
            others = [r for r in step.ops]
        else:
            own = sum(r.seconds for r in step.ops)
            how = ", ".join(sorted({r.how for r in step.ops}))
            others = []
        extra = "; ".join(f"{r.opcode} {r.hbm_bytes / MIB:.4g} MiB {_us(r.seconds)}"
                          for r in others) or "-"
        out.append(OpResult(row.id, setup, predicted, own, (own / predicted - 1) * 100,
                            step.step_seconds, extra, how, captured.compile_seconds))
        print(f"{row.id}: predicted {predicted * 1e6:.2f} us, HLO path {own * 1e6:.2f} us "
              f"({out[-1].diff_pct:+.2f}%), module {step.step_seconds * 1e6:.2f} us [{how}]",
              file=sys.stderr)
    return out


def _us(s: float) -> str:
    return f"{s * 1e3:.4g} ms" if s >= 1e-3 else f"{s * 1e6:.4g} us"


def print_single_op(results: list[OpResult], markdown: bool) -> None:
    header = ("id", "setup", "single-op prediction", "HLO path: the op", "difference",
              "costed as", "HLO path: the module", "the module's other kernels")
    lines = [(r.id, r.setup, _us(r.predicted_s), _us(r.hlo_op_s), f"{r.diff_pct:+.2f}%", r.how,
              _us(r.module_s), r.others) for r in results]
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        for line in [header, *lines]:
            print("  ".join(str(x) for x in line))
    worst = max(results, key=lambda r: abs(r.diff_pct))
    print(f"\nlargest difference {worst.id} {worst.diff_pct:+.2f}% over {len(results)} rows")


# ------------------------------------------------------------------------- (b) training

def compile_oracle(rid: str, out_dir: str, libtpu_args: str, python: str = sys.executable,
                   drop_refused: bool = False) -> None:
    """Compile the oracle's row ``rid`` (tools/xla_oracle, its own process, in ``python``'s
    environment) with XLA's TPU flags ``libtpu_args`` (less those libtpu 0.0.50 refuses on
    the row's chip, ``tools.xla_oracle.maxtext_step.REFUSED_FLAGS``, with ``drop_refused``);
    writes ``out_dir/hlo/<rid>.hlo.txt.gz`` and ``out_dir/results/<rid>.json`` (the oracle's
    result with this compile's memory, flags and versions)."""
    import gzip

    import yaml

    sys.path.insert(0, ROOT)
    from tools.xla_oracle.compile_one import compile_in_child
    from tools.xla_oracle.spec import resolve

    with open(os.path.join(ROOT, "tools", "xla_oracle", "configs.yaml")) as f:
        spec = resolve(rid, yaml.safe_load(f)[rid])
    if drop_refused:
        from tools.xla_oracle.maxtext_step import REFUSED_FLAGS

        refused = REFUSED_FLAGS.get(spec["chip"], ())
        libtpu_args = " ".join(f for f in libtpu_args.split() if f not in refused)
    outcome, hlo = compile_in_child(spec, python=python, libtpu_args=libtpu_args)
    if hlo is None:
        raise SystemExit(f"{rid}: the compile gave no HLO ({outcome.get('stage')}: "
                         f"{str(outcome.get('error'))[:500]})")
    text = hlo.encode()
    os.makedirs(os.path.join(out_dir, "hlo"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "results"), exist_ok=True)
    with open(os.path.join(out_dir, "hlo", f"{rid}.hlo.txt.gz"), "wb") as f:
        f.write(gzip.compress(text, mtime=0))
    with open(os.path.join(ROOT, "tools", "xla_oracle", "results", f"{rid}.json")) as f:
        result = json.load(f)
    result.update(peak_bytes_per_device=outcome["memory"].get("peak_memory_bytes"),
                  libtpu_args=libtpu_args, compile=outcome.get("compile_seconds"),
                  versions=outcome.get("versions"))
    with open(os.path.join(out_dir, "results", f"{rid}.json"), "w") as f:
        json.dump(result, f, indent=1)


#: Op categories of the per-op diff: (name, HLO op_name / source pattern, built-in record
#: name pattern); the first that matches takes an op.
CATEGORIES = (
    ("flash attention kernels", r"flash|splash", r"attention/flash"),
    # a mixture of experts' (T8, MaxText's dense einsum dispatch): the experts' matmuls, the
    # router and the one-hot dispatch / combine einsums, as the built-in path's mlp/ records
    ("MLP matmuls", r"bte,ef->btf|btf,fe->bte|btf,ef->bte"
     r"|xbcm,xmf->xbcf|xbcf,xfm->xbcm|bsm,bsxc->xbcm|xbcm,bsxc->bsm|bsm,mx->bsx", r"^mlp/"),
    ("attention projections", r"bte,e[nk]d->bt[nk]d|bt[nk]d,[nk]de->bte",
     r"^attention/(query|key|value|out|d_out|d_context|d_query|dx_query|d_key|dx_key"
     r"|d_value|dx_value|qkv)"),
    ("logits, embedding, loss", r"btv|,ve->|ve,|logits|embed|xent|cross_entropy",
     r"unembed|embed/|xent"),
    ("optimizer", r"scale_by_adam|clip_by_global|tree_|schedule|safe_increment|apply_updates"
     r"|optax", r"adamw|grad_mean"),
    ("other (norms, rotary, element-wise, copies)", r".", r"."),
)


#: The same categories for a module with JAX's stack frame tables (MaxText 0.2.5's NNX step,
#: whose op names carry no einsum): patterns on the functions of each op's stack frames.
FRAME_CATEGORIES = (
    ("flash attention kernels", r"tpu_flash_attention|_splash_attention"),
    ("MLP matmuls", r"MlpBlock\."),
    ("attention projections", r"Attention\.(query|kv|out|qkv)_projection"),
    ("logits, embedding, loss", r"attend_on_embedding|embed_tokens|Embed\.__call__"
     r"|cross_entropy|logits"),
    ("optimizer", r"Optimizer\.update|clip_by_global_norm|scale_by_adam|apply_updates"
     r"|global_norm|schedule"),
    ("other (norms, rotary, element-wise, copies)", r"."),
)


def stack_functions(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the functions that led to it, outermost to innermost, joined by
    " > " (``pod.hlo.HloModule.call_chain_of``: the module's source tables, which jax 0.10.2
    and 0.12 write, and ``stack_frame_id=N`` in each op's metadata), for every instruction
    with a stack frame. Empty for a module without them."""
    from pod.hlo import parse_hlo

    module = parse_hlo(hlo_text)
    if not module.frames:
        return {}
    return {instr.name: module.call_chain_of(instr) for _, instr in module.instructions()
            if instr.metadata.get("stack_frame_id")}


def _frame_category(functions: str) -> str:
    import re

    for name, pattern in FRAME_CATEGORIES:
        if re.search(pattern, functions):
            return name
    return FRAME_CATEGORIES[-1][0]


def _category(text: str, which: int) -> str:
    import re

    for row in CATEGORIES:
        if re.search(row[which], text):
            return row[0]
    return CATEGORIES[-1][0]


@dataclass(frozen=True)
class TrainingResult:
    """A training row on both paths (simulated seconds per step)."""

    id: str
    published_s: float
    builtin_s: float
    hlo_s: float
    hlo_compute_s: float
    hlo_exposed: dict
    builtin_compute_s: float
    builtin_exposed: dict
    categories: dict
    hlo_memory_gib: float
    xla_memory_gib: float | None
    builtin_memory_gib: float
    exposed_ops: dict = field(default_factory=dict)
    collective_rows: dict = field(default_factory=dict)


def _builtin(scenario: str) -> tuple[Any, Any, dict[str, float]]:
    """The built-in path's plan, step and seconds per op category (timing-only)."""
    from collections import defaultdict

    from pod.config.plan import build_plan
    from pod.config.scenario import load_scenario
    from pod.runtime.timing import TimingPod

    plan = build_plan(load_scenario(os.path.join(ROOT, scenario)), timing_only=True)
    pod = TimingPod(plan)
    stats = pod.step(1)
    pod.device_reports(1, trace=True)
    report = pod.last_report
    cats: dict[str, float] = defaultdict(float)
    for name, _unit, seconds, *_ in report.trace:
        cats[_category("/".join(p for p in name.split("/") if not p.startswith("block")), 2)] \
            += seconds
    return plan, stats, dict(cats)


def _oracle_devices(result: dict) -> tuple[int, ...]:
    """The physical device of each of the oracle module's device ids: its mesh laid out by
    ``mesh_utils.create_device_mesh`` on the compile topology (tools/xla_oracle/step.py),
    read off the devices' coordinates; () without libtpu (the TPU's device order)."""
    from pod.frontends import tpu_compile_available

    if not tpu_compile_available() or result["slices"] != 1:
        return ()
    from pod.frontends.jax_capture import _jax, _quiet_stderr, _topology_options

    jax = _jax("tpu", result["devices"])
    import numpy as np
    from jax.experimental import mesh_utils, topologies

    topo = result["topology"]["name"]
    shape = tuple(result["topology"]["shape"])
    with _quiet_stderr():
        devices = topologies.get_topology_desc(topology_name=topo, platform="tpu",
                                               **_topology_options(topo, 1)).devices
    axes = _oracle_axes(result)
    try:
        grid = mesh_utils.create_device_mesh(tuple(axes.values()), devices)
    except (NotImplementedError, ValueError):
        grid = mesh_utils.create_device_mesh(tuple(axes.values()), devices,
                                             allow_split_physical_axes=True)
    del jax
    return tuple(int(np.ravel_multi_index(tuple(d.coords)[:len(shape)], shape))
                 for d in grid.flat)


def _oracle_axes(result: dict) -> dict[str, int]:
    """The oracle's mesh axes in MaxText's order for its era, sizes from the row's mesh."""
    order = {"2023": ("data", "fsdp", "sequence", "tensor"),
             "2025": ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context",
                      "context_autoregressive", "tensor", "tensor_transpose", "tensor_sequence",
                      "expert", "autoregressive")}[result["model"].get("era", "2025")]
    ici = result["mesh"]["ici"]
    return {axis: int(ici.get(axis, 1)) for axis in order}


def _module_axes(result: dict) -> dict[str, int]:
    """The module's mesh axes: a MaxText record's own (``mesh_axes``, its axes of size > 1 in
    MaxText's order: the same device ids), else the oracle's."""
    if result.get("mesh_axes"):
        return {k: int(v) for k, v in result["mesh_axes"].items() if int(v) > 1}
    return _oracle_axes(result)


def _module_devices(result: dict) -> tuple[int, ...]:
    """The physical device of each module device id: a MaxText record's ``device_order``
    (read off its compile's mesh), else the oracle's layout."""
    if result.get("device_order"):
        return tuple(int(d) for d in result["device_order"])
    return _oracle_devices(result)


def run_training(ids: list[str], hlo_dir: str) -> list[TrainingResult]:
    import fidelity

    import pod.jax

    out = []
    for rid in ids:
        # a record beside the HLO (tools.xla_oracle.maxtext_step's, MaxText's own step)
        # before the oracle's results/
        meta_path = os.path.join(hlo_dir, f"{rid}.json")
        if not os.path.exists(meta_path):
            meta_path = os.path.join(hlo_dir, "..", "results", f"{rid}.json")
        hlo_path = os.path.join(hlo_dir, f"{rid}.hlo.txt.gz")
        if not os.path.exists(hlo_path):
            print(f"{rid}: no HLO at {hlo_path}; skipped", file=sys.stderr)
            continue
        with open(meta_path) as f:
            result = json.load(f)
        row = next(r for r in fidelity.TRAINING_ROWS if r.id == rid)
        plan, stats, builtin_cats = _builtin(row.scenario)
        published = fidelity.training_flops(plan, row.formula) / (row.published_tflops * 1e12)
        est = pod.jax.cost_hlo(hlo_path, slice=result["slice"], num_slices=result["slices"],
                               mesh=_module_axes(result), devices=_module_devices(result))
        step = est.step
        from collections import defaultdict

        cats: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for name, seconds in builtin_cats.items():
            cats[name][0] += seconds
        import gzip

        with gzip.open(hlo_path, "rt") as f:
            frames = stack_functions(f.read())
        for op in step.ops:
            key = op.name.lstrip("%")
            cat = (_frame_category(frames[key]) if key in frames
                   else _category(f"{op.op_name} {op.source} {op.name}", 1))
            cats[cat][1] += op.seconds
        lanes = step.stats.axis_exposed_seconds
        cats["exposed collectives"] = [stats.exposed_collective_seconds,
                                       step.stats.exposed_collective_seconds]
        peak = result.get("peak_bytes_per_device")
        out.append(TrainingResult(
            rid, published, stats.step_seconds, step.step_seconds, step.stats.compute_seconds,
            {k: round(v, 4) for k, v in lanes.items() if v > 1e-4}, stats.compute_seconds,
            {k: round(v, 4) for k, v in stats.axis_exposed_seconds.items() if v > 1e-4},
            {k: tuple(v) for k, v in cats.items()}, step.memory.estimate_bytes / 2**30,
            peak / 2**30 if peak else None, plan.memory["total"] / 2**30,
            {k: round(v, 4) for k, v in exposed_by_op(step).items()},
            {c.name.lstrip("%"): {"op_name": "/".join(c.op_name.split("/")[-2:]),
                                  "lane": c.lane, "op": c.op, "form": c.form,
                                  "nbytes": c.nbytes, "count": c.count,
                                  "seconds": round(c.seconds, 4)}
             for c in step.collectives}))
        r = out[-1]
        print(f"{rid}: published {published:.3f} s, built-in {r.builtin_s:.3f} s, HLO path "
              f"{r.hlo_s:.3f} s", file=sys.stderr)
    return out


def exposed_by_op(step: Any) -> dict[str, float]:
    """Each wait of the compute stream charged to the collective it waited for: the span on
    the wait's lane that ends where the wait ends (the tag of the span, the HLO instruction
    that starts it), simulated seconds per step summed over its runs; waits with no such
    span (a collective running past the compute's end) under ``(end of step)``. Keys: the
    instruction names."""
    from collections import defaultdict

    spans = defaultdict(list)
    for span in step.clock.spans:
        spans[span.axis].append(span)
    out: dict[str, float] = defaultdict(float)
    for start, end, lane in step.clock.waits:
        match = [sp for sp in spans.get(lane, ()) if abs(sp.end - end) <= 1e-9 * max(1.0, end)]
        out[match[0].tag.split(" (")[0] if match else "(end of step)"] += end - start
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def print_exposed(results: list[TrainingResult], top: int) -> None:
    """The collectives the compute stream waited for most, per row."""
    for r in results:
        print(f"\n{r.id}, exposed collectives per op (simulated seconds per step):\n")
        print("| op | JAX op | lane | collective | bytes per device | runs | cost, all runs "
              "| exposed |")
        print("|---|---|---|---|---|---|---|---|")
        for name, seconds in list(r.exposed_ops.items())[:top]:
            row = r.collective_rows.get(name, {})
            print(f"| {name} | {row.get('op_name', '-')} | {row.get('lane', '-')} | "
                  f"{row.get('op', '-')} "
                  f"({row.get('form', '-')}) | {row.get('nbytes', 0) / MIB:.0f} MiB | "
                  f"{row.get('count', '-')} | {row.get('seconds', 0.0):.3f} s | "
                  f"{seconds:.3f} s |")


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f}%"


def print_training(results: list[TrainingResult]) -> None:
    print("| row | published | built-in path | HLO path | HLO vs published | HLO vs built-in "
          "| HLO compute | HLO exposed collectives (lane: s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        exposed = ", ".join(f"{k} {v:.3f}" for k, v in r.hlo_exposed.items()) or "-"
        print(f"| {r.id} | {r.published_s:.3f} s | {r.builtin_s:.3f} s "
              f"({_pct(r.builtin_s, r.published_s)}) | {r.hlo_s:.3f} s | "
              f"{_pct(r.hlo_s, r.published_s)} | {_pct(r.hlo_s, r.builtin_s)} | "
              f"{r.hlo_compute_s:.3f} s | {exposed} |")
    for r in results:
        print(f"\n{r.id}, per op category (simulated seconds per step):\n")
        print("| category | built-in path | HLO path | difference |")
        print("|---|---|---|---|")
        for name, (b, h) in sorted(r.categories.items(), key=lambda kv: -max(kv[1])):
            diff = f"{h - b:+.3f} s" + (f" ({_pct(h, b)})" if b > 0 else "")
            print(f"| {name} | {b:.3f} | {h:.3f} | {diff} |")


def print_memory(results: list[TrainingResult]) -> None:
    print("| row | XLA's buffer assignment (TPU compile) | HLO path's estimate from the "
          "schedule | difference | built-in HBM plan | difference |")
    print("|---|---|---|---|---|---|")
    for r in results:
        xla = r.xla_memory_gib
        print(f"| {r.id} | {f'{xla:.2f} GiB' if xla else '-'} | {r.hlo_memory_gib:.2f} GiB | "
              f"{_pct(r.hlo_memory_gib, xla) if xla else '-'} | {r.builtin_memory_gib:.2f} GiB | "
              f"{_pct(r.builtin_memory_gib, xla) if xla else '-'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single-op", action="store_true", help="(a) the rows C1-C14")
    parser.add_argument("--training", action="store_true", help="(b) the training rows (--rows)")
    parser.add_argument("--memory", action="store_true", help="(c) memory beside XLA's")
    parser.add_argument("--path", choices=["tpu", "cpu"], default="tpu",
                        help="compile for the TPU (libtpu) or fake CPU devices")
    parser.add_argument("--markdown", action="store_true", help="tables for VALIDATION.md")
    parser.add_argument("--json", action="store_true", help="rows as JSON")
    parser.add_argument("--rows", default="T1,T2,T3,T4", help="training rows (comma-separated)")
    parser.add_argument("--compile-maxtext-flags", metavar="DIR",
                        help="compile --rows with the oracle and MaxText's 2023 XLA flags "
                             "(MAXTEXT_2023_LIBTPU_ARGS) into DIR/hlo and DIR/results (minutes "
                             "each; needs libtpu and tools/xla_oracle)")
    parser.add_argument("--compile-xla-defaults", metavar="DIR",
                        help="compile --rows with the oracle and XLA's default flags (no "
                             "LIBTPU_INIT_ARGS; the committed HLO of T1-T4, M1, M2 has their "
                             "runs' flags) into DIR/hlo and DIR/results")
    parser.add_argument("--host-offload-flags", action="store_true",
                        help="with --compile-maxtext-flags: also the host-offload scheduler "
                             "flags (MAXTEXT_HOST_OFFLOAD_LIBTPU_ARGS)")
    parser.add_argument("--hlo-dir", default=os.path.join(ROOT, "tools", "xla_oracle", "hlo"),
                        help="where the oracle's <row>.hlo.txt.gz are (results/ beside it; a "
                             "<row>.json beside the HLO first, as tools/xla_oracle/hlo-maxtext "
                             "has: MaxText's own step, tools.xla_oracle.maxtext_step)")
    parser.add_argument("--compile-python", default=sys.executable, metavar="PY",
                        help="the interpreter of the --compile-* compiles (e.g. "
                             ".venv-maxtext/bin/python: the oracle's step on MaxText's jax and "
                             "libtpu)")
    parser.add_argument("--drop-refused-flags", action="store_true",
                        help="with --compile-maxtext-flags: drop the flags libtpu 0.0.50 "
                             "refuses on the row's chip, as tools.xla_oracle.maxtext_step does")
    parser.add_argument("--exposed-ops", type=int, default=0, metavar="N",
                        help="with --training: the N collectives the compute stream waited "
                             "for most, per row")
    args = parser.parse_args(argv)
    compiles = []  # (out_dir, LIBTPU_INIT_ARGS)
    if args.compile_maxtext_flags:
        compiles.append((args.compile_maxtext_flags, MAXTEXT_2023_LIBTPU_ARGS + (
            MAXTEXT_HOST_OFFLOAD_LIBTPU_ARGS if args.host_offload_flags else "")))
    if args.compile_xla_defaults:
        compiles.append((args.compile_xla_defaults, ""))
    for out_dir, libtpu_args in compiles:
        for rid in args.rows.split(","):
            compile_oracle(rid, out_dir, libtpu_args, args.compile_python,
                           args.drop_refused_flags)
    if args.training or args.memory:
        results = run_training(args.rows.split(","), args.hlo_dir)
        if args.json:
            print(json.dumps([asdict(r) for r in results], indent=2))
        elif args.training:
            print_training(results)
        if args.memory and not args.json:
            print_memory(results)
        if args.exposed_ops and not args.json:
            print_exposed(results, args.exposed_ops)
    if args.single_op:
        results = run_single_op(args.path)
        if args.json:
            print(json.dumps([asdict(r) for r in results], indent=2))
        else:
            print_single_op(results, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
