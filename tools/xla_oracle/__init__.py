"""The XLA oracle: XLA's own memory verdict and op inventory for training configurations.

``python -m tools.xla_oracle`` (``make oracle``) compiles, for each configuration of
``configs.yaml``, a MaxText-style training step of the project's transformer for the
scenario's TPU slice with no TPU (``jax.experimental.topologies``), and writes
``results/<id>.json``: ``compiled.memory_analysis()``, XLA's peak bytes per device, the fit
verdict against the chip preset's HBM, and the op inventory of the scheduled HLO. See
docs/xla-oracle.md.

Modules: ``spec`` (configurations -> compile specs with the project's loader; no jax),
``sharding`` (MaxText's mesh axes and logical axis rules; no jax), ``model`` and ``step``
(the JAX reference and its compile; need the ``tpu-compile`` extra), ``compile_one`` (one
compile in its own process), ``inventory`` (the HLO op inventory; pure Python), ``record``
(the result record and its JSON schema).
"""
