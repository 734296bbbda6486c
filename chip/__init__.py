"""One TPU chip in pure Python + numpy: specs, numerics and cost models.

A `Chip` holds `TensorCore`s; each runs matmuls (MXU, bf16 x bf16 -> fp32)
and vector ops (VPU) with numpy, returns the real result, and records an
`OpRecord` of the simulated time the real core would take (roofline of
compute cycles vs HBM traffic). The MXU count is "pipelined" (the TPU's, one
bubble per op) or "scalesim" (SCALE-Sim's, a bubble per fold); `MXU_MODELS`.
Specs for TPU v2 to v6e are in `PRESETS`, every figure with its public source.

This package never imports ray, pod or interconnect.
"""

from chip.chip import Chip
from chip.core import FUSIONS, PRECISIONS, OpRecord, TensorCore, check_precision
from chip.errors import ChipError, ChipSpecError, HBMOutOfMemoryError, PrecisionError
from chip.hbm import HBM
from chip.mxu import MXU_MODELS, check_mxu_model, conv2d_gemm_shape, mxu_folds, mxu_gemm_cycles
from chip.numerics import (
    FP32_PASSES,
    dequantize_int8,
    mxu_matmul,
    mxu_matmul_aqt_int8,
    mxu_matmul_fp32,
    mxu_matmul_int8,
    quantize_int8,
    quantize_int8_channels,
    split_bf16x3,
    to_bf16,
)
from chip.scalar import scalar_cycles
from chip.spec import (
    PRESETS,
    WRAPAROUND_RULES,
    ChipSpec,
    MXUSpec,
    TensorCoreSpec,
    get_chip_spec,
)
from chip.vector import vpu_cycles

__all__ = [
    "MXUSpec",
    "TensorCoreSpec",
    "ChipSpec",
    "WRAPAROUND_RULES",
    "PRESETS",
    "get_chip_spec",
    "ChipError",
    "ChipSpecError",
    "HBMOutOfMemoryError",
    "PrecisionError",
    "PRECISIONS",
    "FUSIONS",
    "check_precision",
    "HBM",
    "OpRecord",
    "TensorCore",
    "Chip",
    "to_bf16",
    "mxu_gemm_cycles",
    "MXU_MODELS",
    "check_mxu_model",
    "mxu_folds",
    "conv2d_gemm_shape",
    "mxu_matmul",
    "mxu_matmul_fp32",
    "mxu_matmul_int8",
    "mxu_matmul_aqt_int8",
    "quantize_int8_channels",
    "split_bf16x3",
    "FP32_PASSES",
    "quantize_int8",
    "dequantize_int8",
    "vpu_cycles",
    "scalar_cycles",
]
