"""A user's own tiny JAX step for the capture tests: a tanh layer's weight gradient, the
weight split 4 ways over "model", the batch 2 ways over "data"."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH = {"data": 2, "model": 4}


def step(w, x):
    def loss(w):
        return jnp.mean(jnp.tanh(x @ w).astype(jnp.float32) ** 2)
    return jax.grad(loss)(w)


def step_args(mesh):
    return (jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P(None, "model"))),
            jax.ShapeDtypeStruct((256, 512), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P("data"))))


def broken(w, x):
    return w @ x  # (512, 1024) @ (256, 512): the inner dimensions differ


def broken_args(mesh):
    return step_args(mesh)
