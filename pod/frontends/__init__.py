"""Front ends: the only package that imports jax (``pod.frontends.jax_capture``).

A front end turns a user's program into an XLA HLO module that ``pod.hlo``
costs. jax is imported inside the functions that need it, so importing this
package costs nothing without jax.
"""

from pod.frontends.jax_capture import PATHS, Capture, cache_dir, capture, tpu_compile_available

__all__ = ["PATHS", "Capture", "capture", "cache_dir", "tpu_compile_available"]
