"""AQT int8 training as MaxText runs it (``quantization: int8``): what is int8 and what is not.

MaxText's ``quantization: int8`` (``MaxText/configs/base.yml`` at tpu-recipes-v0.1.4,
../shared/reference/maxtext/base-tpu-recipes-v0.1.4.yml: "'int8' for dynamic range
quantization using 8-bits"; ``int8_training: True`` in the 2023 base) builds an AQT
configuration (Google's Accurate Quantized Training library, ``aqt.jax.v2``;
MaxText ``layers/quantizations.py``, ``_get_int8_quant_config``: ``fwd_bits=8``,
``dlhs_bits=8``, ``drhs_bits=8`` when ``quantization_local_shard_count`` is not 0, its
default -1 meaning one shard per slice; int32 accumulators) and hands it to the
layers built with ``DenseGeneral`` / the MoE's expert einsums. So, per training step:

- **int8** (each operand quantised symmetrically with one scale per channel over the
  contraction axis, int8 x int8 products accumulated in int32, rescaled after): the
  three products of every projection, forward (x W), the input gradient (dy W^T,
  AQT's "dlhs") and the weight gradient (x^T dy, "drhs"): the attention's query, key,
  value (or fused qkv) and output projections, the MLP's input and output
  projections, an MoE's experts (``chip.TensorCore.matmul(quantized=True)``,
  ``chip.numerics.mxu_matmul_aqt_int8``);
- **bf16**: the attention kernel's score and value products (flash or dot-product;
  MaxText quantises attention only for a KV cache at inference), the output layer's
  logits (``logits_dense`` / the tied embedding's ``attend`` take no quantisation),
  the embedding lookup, an MoE's router and dense dispatch masks, and every VPU op
  (norms, activations, softmax, the optimizer) in the activation dtype.

Cost: an int8 product runs at the MXU's int8 rate (``spec.int8_macs_per_bf16_mac``:
2 on v5e, v5p and v6e, 1 on v4, none on v2 / v3, which refuse it); its operands are
read from HBM as stored (bf16) and quantised on the fly (a VPU op fused into the
product, ``chip.core.QUANTIZE_OPS_PER_ELEMENT``), its output dequantised in the
epilogue and written in bf16. Numerics: round to nearest (AQT's stochastic rounding of
the backward gradient operand is not modelled).

**MFU.** MaxText prints TFLOP/s per device from its model-FLOPs formula whatever the
dtype (``calculate_tflops_training_per_device``: no term depends on quantisation), and
Google's published int8 figures divide that by the chip's **bf16** peak ("effective
MFU": the Cloud TPU v5e AQT results and MaxText's tables quote int8 runs against the
bf16 peak, which is how an int8 run can exceed 100% of it). The project reports the
same: ``pod.report.stats.mfu`` divides model FLOPs by the bf16 peak for every run, and
the int8 MXU work shows only in the step time and the hardware FLOPs.
"""

from __future__ import annotations

from chip import TensorCoreSpec

__all__ = ["QUANTIZATIONS", "check_quantization"]

#: ``quantization`` values (MaxText's): "" bf16 products; "int8" AQT int8 training
QUANTIZATIONS = ("", "int8")


def check_quantization(quantization: str, core: TensorCoreSpec, chip_name: str) -> None:
    """Checks that the chip's MXU runs the quantised products.

    Raises:
        ValueError: int8 on an MXU without int8 throughput (TPU v2, v3), one line.
    """
    if quantization == "int8" and core.int8_macs_per_bf16_mac <= 0:
        raise ValueError(f"quantization 'int8' needs an MXU with int8 throughput, which TPU "
                         f"{chip_name} does not have (int8 runs on v4, v5e, v5p, v6e); use "
                         f"quantization \"\" (bf16)")
