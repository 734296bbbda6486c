"""Write the small HLO modules the tests of ``pod.hlo`` read (tests/data/hlo/).

Each is a tiny JAX step compiled twice: for a TPU slice with no TPU attached
(libtpu, ``jax.experimental.topologies``) and over fake CPU devices; the text
XLA prints (``compiled.as_text()``) is stored gzipped, with the source file's
directory removed from the module's FileNames table. Run once when the snippets
change (needs ``pip install -e '.[tpu-compile]'``)::

    python tools/hlo_snippets.py            # both platforms
    python tools/hlo_snippets.py --cpu      # the CPU ones only (no libtpu)
    python tools/hlo_snippets.py --sparsecore   # embed_gather (jax 0.12 / libtpu 0.0.50)

The modules:

- ``mlp_scan``: a 3-layer MLP under ``lax.scan`` and its gradient, weights split 4
  ways over "model", the batch 2 ways over "data" (8 devices): while loops with
  and without XLA's ``known_trip_count``, all-reduces over explicit and iota
  replica groups, TPU async copies;
- ``fsdp_block``: a 2-layer attention + MLP block under ``lax.scan`` with
  ``jax.checkpoint``, parameters sharded over "fsdp" (4) and "tensor" (2), and a
  weight update: all-gathers (XLA TPU's async collective fusions), gradient
  reduce-scatters, ``mesh[...]`` replica groups;
- ``ring_permute``: ``jax.lax.ppermute`` round a ring of 8 in ``shard_map``
  (``collective-permute`` with ``source_target_pairs``);
- ``matmul``: one (512, 1024) x (1024, 256) bf16 matmul on one device;
- ``embed_gather`` (``--sparsecore``, TPU only, for v5p 2x2x1): an embedding lookup
  (``jnp.take`` of 4,096 tokens per device from a (32768, 2048) bf16 table) and a
  (2048, 2048) matmul, the batch 4 ways over "data". libtpu 0.0.50 (jax[tpu] 0.12.0.1,
  Python 3.12: MaxText's venv) offloads the gather to the SparseCore: a ``call-start`` /
  ``call-update`` / ``call-done`` on ``execution_thread="sparsecore"``; libtpu 0.0.42
  does not (nor does 0.0.50 for a table of 4,096 x 1,024), so it has a flag of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "hlo"
TPU = "v5e:2x4"
SPARSECORE_TPU = "v5p:2x2x1"


def _setup(platform: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    if platform == "cpu":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    else:
        os.environ.update(TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")


def _devices(jax, platform: str, topology: str = TPU):
    if platform == "cpu":
        return jax.devices("cpu")[:8]
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices


def _steps(jax):
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    bf = jnp.bfloat16

    def mlp_loss(w1, w2, x):
        def body(h, ws):
            return jax.nn.relu(h @ ws[0]) @ ws[1], None
        h, _ = jax.lax.scan(body, x, (w1, w2))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    def block(x, p):
        wq, wo, w1, w2 = p
        q = jnp.einsum("btd,dhk->bthk", x, wq)
        s = jnp.einsum("bthk,bshk->bhts", q, q) / 8.0
        o = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, axis=-1), q)
        x = x + jnp.einsum("bthk,hkd->btd", o, wo)
        return x + jax.nn.gelu(x @ w1) @ w2, None

    def fsdp_step(params, x):
        def loss(params, x):
            y, _ = jax.lax.scan(jax.checkpoint(block), x, params)
            return jnp.mean(y.astype(jnp.float32) ** 2)
        value, grads = jax.value_and_grad(loss)(params, x)
        return value, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    def ring(x):
        n = jax.lax.axis_size("ring")
        return jax.lax.ppermute(x, "ring", [(i, (i + 1) % n) for i in range(n)])

    s = jax.ShapeDtypeStruct
    layers, d, f, h, b, t = 2, 256, 1024, 4, 4, 128
    return {
        "mlp_scan": ({"data": 2, "model": 4}, jax.grad(mlp_loss, argnums=(0, 1)),
                     (s((3, 256, 1024), bf), s((3, 1024, 256), bf), s((64, 256), bf)),
                     (P(None, None, "model"), P(None, "model", None), P("data", None))),
        "fsdp_block": ({"fsdp": 4, "tensor": 2}, fsdp_step,
                       ((s((layers, d, h, d // h), bf), s((layers, h, d // h, d), bf),
                         s((layers, d, f), bf), s((layers, f, d), bf)), s((b, t, d), bf)),
                       ((P(None, "fsdp", "tensor"), P(None, "tensor", None, "fsdp"),
                         P(None, "fsdp", "tensor"), P(None, "tensor", "fsdp")), P("fsdp"))),
        "ring_permute": ({"ring": 8}, ("shard_map", ring), (s((8 * 1024,), bf),), (P("ring"),)),
        "matmul": ({"one": 1}, lambda a, w: a @ w, (s((512, 1024), bf), s((1024, 256), bf)),
                   (P(), P())),
    }


def _sparsecore_steps(jax):
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def embed_step(table, w, tokens):
        x = jnp.take(table, tokens, axis=0)
        return (x @ w).astype(jnp.float32).sum()

    s = jax.ShapeDtypeStruct
    return {"embed_gather": ({"data": 4}, embed_step,
                             (s((32768, 2048), jnp.bfloat16), s((2048, 2048), jnp.bfloat16),
                              s((8, 2048), jnp.int32)), (P(), P(), P("data")))}


def _compile(jax, platform: str, name: str, spec, topology: str = TPU) -> str:
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    axes, fn, args, specs = spec
    devices = _devices(jax, platform, topology)
    size = int(np.prod(list(axes.values())))
    mesh = Mesh(np.array(devices[:size], dtype=object).reshape(tuple(axes.values())), tuple(axes))
    if isinstance(fn, tuple):  # shard_map
        fn = jax.shard_map(fn[1], mesh=mesh, in_specs=specs, out_specs=specs[0])
    shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), specs,
                             is_leaf=lambda v: isinstance(v, jax.sharding.PartitionSpec))
    with jax.set_mesh(mesh):
        text = jax.jit(fn, in_shardings=shardings).lower(*args).compile().as_text()
    return re.sub(r'^(\d+ )"[^"\n]*/([^"/\n]+)"$', r'\1"\2"', text, flags=re.M)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="only the CPU-compiled modules")
    parser.add_argument("--sparsecore", action="store_true",
                        help=f"only embed_gather, for {SPARSECORE_TPU} (jax 0.12 / libtpu 0.0.50)")
    parser.add_argument("--platform", choices=["tpu", "cpu"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sparsecore:
        args.platform = "tpu"
    if args.platform is None:  # each platform in a process of its own (XLA flags at start)
        import subprocess

        for platform in (["cpu"] if args.cpu else ["tpu", "cpu"]):
            subprocess.run([sys.executable, __file__, "--platform", platform], check=True)
        return 0
    _setup(args.platform)
    with contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115
        import jax
    OUT.mkdir(parents=True, exist_ok=True)
    steps, topology = (_sparsecore_steps(jax), SPARSECORE_TPU) if args.sparsecore \
        else (_steps(jax), TPU)
    for name, spec in steps.items():
        text = _compile(jax, args.platform, name, spec, topology)
        if args.sparsecore and 'execution_thread="sparsecore"' not in text:
            raise SystemExit(f"{name}: this libtpu did not offload the gather to the "
                             "SparseCore (needs jax[tpu] 0.12.0.1 / libtpu 0.0.50.1)")
        path = OUT / f"{name}.{args.platform}.hlo.txt.gz"
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
        print(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
