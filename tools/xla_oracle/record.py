"""The oracle's per-config result: build it from a compile outcome, its JSON schema.

A result (``results/<id>.json``) is what the other streams read. Its memory figures come
from XLA's buffer assignment, ``compiled.memory_analysis()``, per device:

- ``peak_bytes_per_device``: XLA's ``peak_memory_in_bytes``, the peak of the bytes live at
  once over the program in the heap simulation of its buffer assignment (the entry's
  arguments, the train state and the batch, included). This is the figure to compare with
  HBM.
- ``sum_bytes_per_device``: argument + output - alias + temp. Not a peak: on TPU the temp
  figure adds allocations that are never live together (T1, 32B on v5p-128, reports 100 GB
  of temp on a 95 GiB chip it ran on, and XLA's peak is 85 GiB); kept as an upper bound.
- ``memory``: every field as the jaxlib reports it (``*_bytes``; ``host_*`` the pinned
  host memory that offloaded activations use).

``fits`` is XLA's verdict as the project reads it: the compile succeeded and the peak is at
most the HBM XLA makes available on the device (``hbm_bytes_per_device``: ``device_hbm_bytes``,
the preset's ``hbm_available_bytes``). A compile XLA refuses with RESOURCE_EXHAUSTED on HBM
is ``fits: false`` with its message and, parsed from it, the bytes XLA said it needed and
had (``compile.oom``; the presets' ``hbm_available_bytes`` are those figures).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["SCHEMA_VERSION", "RESULT_SCHEMA", "build_result", "parse_oom", "GIB", "versions"]

SCHEMA_VERSION = 1
GIB = 2 ** 30

_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.upper().rstrip("IB")[:1] if unit else ""])


def parse_oom(message: str) -> dict[str, Any] | None:
    """The bytes an XLA RESOURCE_EXHAUSTED message states, in either of its forms:

    - "the total memory required for HLO temporaries (164.66G) exceeds available HBM
      (95.74G)" -> {"required_bytes", "available_bytes", "required_of": "HLO temporaries"}
    - "Used 20.5G of 15.75G hbm. Exceeded hbm capacity by 4.75G" -> {"required_bytes",
      "available_bytes", "required_of": "total", "exceeded_bytes"}

    G is read as GiB (XLA prints binary units). None if the message names no bytes.
    """
    out: dict[str, Any] = {}
    m = re.search(r"memory required for ([\w ]+?) \(([\d.]+)\s*([KMGT]?i?B?)\) exceeds "
                  r"available HBM \(([\d.]+)\s*([KMGT]?i?B?)\)", message)
    if m:
        out.update(required_bytes=_bytes(m.group(2), m.group(3)),
                   available_bytes=_bytes(m.group(4), m.group(5)), required_of=m.group(1))
    m = re.search(r"Used\s+([\d.]+)\s*([KMGT]?i?B?)\s+of\s+([\d.]+)\s*([KMGT]?i?B?)\s+hbm",
                  message)
    if m:
        out.update(required_bytes=_bytes(m.group(1), m.group(2)),
                   available_bytes=_bytes(m.group(3), m.group(4)), required_of="total")
    m = re.search(r"Exceeded hbm capacity by\s+([\d.]+)\s*([KMGT]?i?B?)", message)
    if m:
        out["exceeded_bytes"] = _bytes(m.group(1), m.group(2))
    return out or None


def device_peak_bytes(result: Mapping[str, Any]) -> int | None:
    """XLA's peak per device as an HBM figure, or None when the result's peak is not one.

    With activations offloaded to the host (``memory.host_temp_bytes`` > 0), jaxlib's
    ``peak_memory_in_bytes`` can be the arguments plus the host-memory temporaries: T6
    (Llama 3.1 70B, v6e-64, 2 x 8192, layer input and q / k / v offloaded) reports 57.34
    GiB = 12.34 GiB of arguments + 45.00 GiB of host temporaries to 36 KB, and the 45.00
    GiB are the offloaded activations (80 layers x 2 x 8192 tokens x (8192 + 8192 + 1024
    + 1024) x 2 bytes; ``S(5)``, host memory, in the committed HLO). Such a peak says
    nothing of HBM (``pod.hlo.step.peak_counts_host``, the HLO path's rule): None.
    Otherwise the recorded ``peak_bytes_per_device``.

    Args:
        result: a result record (``peak_bytes_per_device``, ``memory``).
    """
    from pod.hlo.step import peak_counts_host

    peak = result.get("peak_bytes_per_device")
    memory = result.get("memory") or {}
    if peak is None or peak_counts_host(peak, memory.get("argument_bytes", 0),
                                        memory.get("host_temp_bytes") or 0):
        return None
    return int(peak)


def judge_peak(peak: int | None, hbm: int,
               memory: Mapping[str, Any] | None = None) -> tuple[bool, str]:
    """A compiled step's verdict: (it fits ``hbm`` bytes a device, the reason).

    A peak that is the arguments plus host-memory temporaries (:func:`device_peak_bytes`:
    activations offloaded to the host) says nothing of HBM; XLA compiled the step, so its
    own check (the HLO temporaries against the chip's HBM, which refuses T1-b16 and T1-none)
    passed: it fits. Otherwise the peak is at most ``hbm``.
    """
    if peak is not None and device_peak_bytes(
            {"peak_bytes_per_device": peak, "memory": memory or {}}) is None:
        return True, ("compiled; the peak is the arguments plus host memory (offloaded "
                      "activations), and XLA's own HBM check passed")
    fits = peak is not None and peak <= hbm
    return fits, ("compiled; peak within the device's HBM" if fits else
                  "compiled, but the peak exceeds the device's HBM in the chip preset")


def build_result(spec: Mapping[str, Any], outcome: Mapping[str, Any],
                 inventory: Mapping[str, Any] | None, key: str,
                 hlo_file: str | None) -> dict[str, Any]:
    """The result record of one config (see ``RESULT_SCHEMA``)."""
    memory = outcome.get("memory")
    ok = bool(outcome.get("ok"))
    hbm = int(spec["hbm_bytes_per_device"])
    peak = total = None
    if memory:
        total = (memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
                 + memory["temp_bytes"])
        peak = memory.get("peak_memory_bytes")
    error: str | None = outcome.get("error")
    vmem = error is not None and "in memory space vmem" in error
    oom = error is not None and "RESOURCE_EXHAUSTED" in error and not vmem
    if ok:
        fits, why = judge_peak(peak, hbm, memory)
    elif oom:
        fits, why = False, "XLA refused the program: RESOURCE_EXHAUSTED"
    elif vmem:
        fits, why = None, ("not decided: a Pallas kernel's scratch ran out of VMEM (the "
                           "reference's flash block sizes), before any HBM verdict")
    else:
        fits, why = None, f"not decided: the {outcome.get('stage', 'compile')} step failed"
    model = dict(spec["model"])
    return {
        "schema_version": SCHEMA_VERSION,
        "id": spec["id"],
        "scenario": spec["scenario"],
        "overrides": list(spec["overrides"]),
        "oracle": dict(spec.get("oracle") or {}),
        "calibration": spec.get("calibration"),
        "note": spec.get("note"),
        "xla_flags": spec.get("xla_flags"),
        "slice": spec["slice"],
        "slices": spec["slices"],
        "chip": spec["chip"],
        "topology": spec["topology"],
        "mesh": {**spec["mesh"], "layout": dict(outcome.get("notes") or {})},
        "devices": spec["devices"],
        "global_batch": spec["global_batch"],
        "per_device_batch": spec["per_device_batch"],
        "sequence_length": spec["sequence_length"],
        "remat": model["remat"],
        "remat_custom": model.get("remat_custom") or {},
        "model": model,
        "param_count": outcome.get("param_count"),
        "versions": dict(outcome.get("versions") or {}),
        "cache_key": key,
        "compile": {"ok": ok, "stage": outcome.get("stage"), "error": error,
                    "oom": parse_oom(error) if oom and error else None,
                    "lower_seconds": outcome.get("lower_seconds"),
                    "compile_seconds": outcome.get("compile_seconds")},
        "memory": memory,
        "peak_bytes_per_device": peak,
        "peak_source": "memory_analysis().peak_memory_in_bytes",
        "sum_bytes_per_device": total,
        "hbm_bytes_per_device": hbm,
        "fits": fits,
        "fits_reason": why,
        "inventory": dict(inventory) if inventory is not None else None,
        "hlo_file": hlo_file,
    }


_INT = {"type": "integer", "minimum": 0}
_INT_OR_NULL = {"type": ["integer", "null"], "minimum": 0}
_MEMORY = {
    "type": ["object", "null"],
    "required": ["argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                 "generated_code_bytes", "host_argument_bytes", "host_output_bytes",
                 "host_alias_bytes", "host_temp_bytes", "peak_memory_bytes"],
    "additionalProperties": _INT,
}
_COLLECTIVE = {
    "type": "object",
    "required": ["op", "dtype", "result_bytes", "operand_bytes", "replica_groups", "async",
                 "count"],
    "properties": {
        "op": {"enum": ["all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                        "collective-permute", "ragged-all-to-all", "collective-broadcast",
                        "send", "recv"]},
        "dtype": {"type": ["string", "null"]},
        "result_bytes": {"type": "number", "minimum": 0},
        "operand_bytes": {"type": "number", "minimum": 0},
        "replica_groups": {"type": ["object", "null"],
                           "required": ["form", "group_size", "groups"],
                           "properties": {"form": {"enum": ["explicit", "iota", "mesh",
                                                            "pairs"]}}},
        "async": {"type": "boolean"},
        "scattered": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 1},
    },
}
#: JSON Schema (draft 2020-12) of ``results/<id>.json``
RESULT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["schema_version", "id", "scenario", "overrides", "slice", "chip", "topology",
                 "mesh", "devices", "global_batch", "per_device_batch", "sequence_length",
                 "remat", "model", "versions", "cache_key", "compile", "memory",
                 "peak_bytes_per_device", "hbm_bytes_per_device", "fits", "inventory"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "id": {"type": "string"},
        "scenario": {"type": "string"},
        "overrides": {"type": "array", "items": {"type": "string"}},
        "slice": {"type": "string"},
        "slices": {"type": "integer", "minimum": 1},
        "chip": {"enum": ["v4", "v5e", "v5p", "v6e"]},
        "topology": {"type": "object", "required": ["name", "shape", "slices"]},
        "mesh": {"type": "object", "required": ["ici", "dcn"]},
        "devices": {"type": "integer", "minimum": 1},
        "global_batch": {"type": "integer", "minimum": 1},
        "per_device_batch": {"type": "number", "exclusiveMinimum": 0},
        "sequence_length": {"type": "integer", "minimum": 1},
        "remat": {"type": "string"},
        "model": {"type": "object", "required": ["embed_dim", "heads", "kv_heads", "head_dim",
                                                 "mlp_dim", "layers", "vocabulary", "era"]},
        "versions": {"type": "object", "required": ["jax", "jaxlib", "libtpu"]},
        "cache_key": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "compile": {"type": "object", "required": ["ok", "error"]},
        "memory": _MEMORY,
        "peak_bytes_per_device": _INT_OR_NULL,
        "sum_bytes_per_device": _INT_OR_NULL,
        "hbm_bytes_per_device": _INT,
        "fits": {"type": ["boolean", "null"]},
        "inventory": {
            "type": ["object", "null"],
            "required": ["collectives", "collective_totals", "fusions", "fusion_count",
                         "custom_calls", "while_loops"],
            "properties": {"collectives": {"type": "array", "items": _COLLECTIVE}},
        },
        "hlo_file": {"type": ["string", "null"]},
        "xla_flags": {"type": ["object", "null"], "required": ["name", "libtpu_args"]},
    },
}


def versions() -> dict[str, str]:
    """jax, jaxlib, libtpu and optax versions ("missing" for one not installed): a result's
    provenance and its cache key. Imports none of them."""
    out = {}
    for name in ("jax", "jaxlib", "libtpu", "optax"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out
