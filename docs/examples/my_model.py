"""A language model of your own: per layer a causal depthwise convolution mixes each channel
over the last few tokens, then a gated MLP; layers under lax.scan with remat. Sharded over
fsdp (parameters and batch) and tensor (the MLP). `tpu-pod run-jax` costs its train_step."""
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH = {"fsdp": 4, "tensor": 2}  # the slice's 8 devices (override with --mesh)
VOCAB, D, F, LAYERS, WIDTH, BATCH, T = 32768, 2048, 8192, 8, 4, 16, 2048


def rms(x):
    scale = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
    return x * scale.astype(x.dtype)


def layer(x, w):
    x = jax.lax.with_sharding_constraint(x, P("fsdp"))               # FSDP: batch stays split
    h = jnp.pad(rms(x), ((0, 0), (WIDTH - 1, 0), (0, 0)))             # causal: pad the past
    x = x + sum(h[:, i:i + x.shape[1]] * w["conv"][i] for i in range(WIDTH))
    h = rms(x)
    return x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"], None


def loss(params, tokens):
    x = params["embed"][tokens[:, :-1]]
    x, _ = jax.lax.scan(jax.checkpoint(layer), x, params["layers"])
    logits = (rms(x) @ params["embed"].T).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


def train_step(params, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    return value, jax.tree.map(lambda p, g: p - 1e-4 * g.astype(p.dtype), params, grads)


def train_step_args(mesh):  # the args factory: shapes and shardings, nothing allocated
    def s(shape, spec, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
    layers = {"conv": s((LAYERS, WIDTH, D), ()),
              "gate": s((LAYERS, D, F), (None, "fsdp", "tensor")),
              "up": s((LAYERS, D, F), (None, "fsdp", "tensor")),
              "down": s((LAYERS, F, D), (None, "tensor", "fsdp"))}
    params = {"embed": s((VOCAB, D), ("tensor", "fsdp")), "layers": layers}
    return params, s((BATCH, T + 1), ("fsdp", None), jnp.int32)
