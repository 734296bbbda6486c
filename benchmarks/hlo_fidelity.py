"""The HLO path beside the project's own predictions (VALIDATION.md, "The HLO path").

(a) ``--single-op``: the shapes of the calibration rows C1-C14 (benchmarks/fidelity.py)
    written as JAX functions, compiled for a TPU with no TPU attached (libtpu; ``--path
    cpu`` over fake CPU devices instead), their HLO costed by ``pod.hlo`` on the row's
    chips, beside the project's single-op prediction of the same row (``fidelity.py``'s
    ``predict``, host dispatch left out of both: the HLO is the device's work).
(b) ``--training``: the calibration training rows T1, T3, T5 as the oracle's JAX
    transformer compiled for their slices (tools/xla_oracle), costed by the HLO path,
    beside the built-in path (the row's scenario, timing-only) and the published figure,
    with a per-op diff of where the two paths differ.
(c) ``--memory``: the HLO path's memory beside XLA's own buffer assignment.

Every time is SIMULATED, except the compile times (wall).

Usage::

    python benchmarks/hlo_fidelity.py --single-op [--markdown] [--path tpu|cpu]
    python benchmarks/hlo_fidelity.py --training [--markdown] [--hlo-dir DIR]
    python benchmarks/hlo_fidelity.py --memory [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

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
            if kind == "psum":
                return jax.lax.psum(x, axis)
            if kind == "psum_scatter":
                return jax.lax.psum_scatter(x, axis, scatter_dimension=x.ndim - 1, tiled=True)
            return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])

        spec = P((*rest, axis)) if kind != "all_gather" else P((*rest, axis))
        out = P(rest or None) if kind in ("all_gather", "psum") else spec
        fn = jax.shard_map(body, in_specs=spec, out_specs=out, check_vma=False)
        total = (per_device[0] * mesh.size,) + per_device[1:]
        return fn, (jax.ShapeDtypeStruct(total, getattr(jnp, dtype)),), (spec,)
    return build


def single_op_rows() -> list[OpRow]:
    """C1-C14 as JAX functions (C6's 2 devices are v2 TensorCores: see VALIDATION.md)."""
    return [
        OpRow("C1", "v5e", (1, 1), "v5e", (1, 1), False, {"one": 1}, _matmul(8192)),
        OpRow("C2", "v5e", (1, 1), "v5e", (1, 1), False, {"one": 1}, _matmul(4096)),
        OpRow("C3", "v5e", (1, 1), "v5e", (1, 1), False, {"one": 1}, _matmul(1024)),
        OpRow("C4", "v5e", (1, 1), "v5e", (1, 1), False, {"one": 1}, _matmul(32768)),
        OpRow("C5", "v6e", (1, 1), "v6e", (1, 1), False, {"one": 1}, _copy),
        OpRow("C7", "v5e", (2, 2), "v5e", (4,), False, {"i": 4},
              _collective("all_gather", (128 * KIB // 2 // 4,), "bfloat16")),
        OpRow("C8", "v5e", (2, 4), "v5e", (2, 4), False, {"i": 8},
              _collective("all_gather", (32768 // 8, 32768), "bfloat16")),
        OpRow("C9", "v5e", (2, 4), "v5e", (2, 4), False, {"i": 8},
              _collective("psum", (128 * MIB,), "int8")),
        OpRow("C10", "v5e", (2, 4), "v5e", (2, 4), False, {"i": 8},
              _collective("all_gather", (GIB // 8,), "int8")),
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single-op", action="store_true", help="(a) the rows C1-C14")
    parser.add_argument("--training", action="store_true", help="(b) T1, T3, T5")
    parser.add_argument("--memory", action="store_true", help="(c) memory beside XLA's")
    parser.add_argument("--path", choices=["tpu", "cpu"], default="tpu",
                        help="compile for the TPU (libtpu) or fake CPU devices")
    parser.add_argument("--markdown", action="store_true", help="tables for VALIDATION.md")
    parser.add_argument("--json", action="store_true", help="rows as JSON")
    args = parser.parse_args(argv)
    if args.single_op:
        results = run_single_op(args.path)
        if args.json:
            print(json.dumps([asdict(r) for r in results], indent=2))
        else:
            print_single_op(results, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
