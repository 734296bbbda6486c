"""Expert parallelism's collectives: a mixture of experts' dispatch and combine as
all-to-alls over the mesh's ``expert`` axis.

A device of an expert group of s devices holds E / s of an MoE layer's E experts
(experts ``i E/s .. (i+1) E/s - 1`` at position i) and its own sequences. Its
MoE layer (``pod.workloads.moe``) routes its tokens and lays them out
expert-major, (E, R, C): piece j of that buffer (the rows of the experts at
position j) is what position j needs. :class:`ExpertCollectives` moves them:

- ``dispatch``: one all-to-all over ``expert``; piece i of the result (E / s
  experts' rows from position i) is laid out expert-major again, (E / s, s R,
  C): each local expert's rows from every position, which its grouped matmul
  takes as one group;
- ``combine``: the transpose back, (E / s, s R, C) -> pieces by position, one
  all-to-all, (E, R, C): every expert's output for this device's tokens.

The layout changes are the DMA's (XLA's all-to-all writes each piece where it
goes): no op is recorded for them. Backward runs the same two in the other
order (the all-to-all is its own transpose). What the clock is told
(``CollectiveCall``): kind "activation" (the compute waits for the tokens),
the whole buffer in the activations' dtype (``wire_itemsize``: bf16 under bf16
precision), tags "<layer>/dispatch <phase>", "<layer>/combine <phase>",
"<layer>/combine_bwd bwd" and "<layer>/dispatch_bwd bwd". On a timing-only
core the calls are issued with zero views of the right sizes. References:
[GShard] Lepikhin et al. 2020, sec. 3.2 (dispatch and combine by AllToAll);
MaxText ``moe.py`` (``expert`` mesh axis, ``activation_exp``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pod.programs.collectives import DeviceCollectives
from pod.programs.tensor import wire_itemsize
from pod.workloads.layers import timing_zeros
from pod.workloads.moe import ExpertHooks

__all__ = ["ExpertCollectives"]

_F32 = np.float32


class ExpertCollectives(ExpertHooks):
    """``ExpertHooks`` over the ``expert`` axis of ``comm`` (module docstring).

    Args:
        core: the device's TensorCore (``after_record`` of each call; ``execute``).
        comm: the device's collectives.
        phase: "fwd", "bwd" or "eval" (the tags' suffix).
    """

    def __init__(self, core, comm: DeviceCollectives, phase: str):
        self.core, self.comm, self.phase = core, comm, phase
        self.shards = comm.axis_size("expert")

    def _all_to_all(self, tag: str, pieces: np.ndarray) -> np.ndarray | None:
        """One all-to-all of ``pieces`` (s, ...) over expert; None on a timing-only core."""
        kw: dict[str, Any] = {"tag": f"{tag} {self.phase}", "kind": "activation",
                              "after_record": len(self.core.records),
                              "itemsize": wire_itemsize(self.core)}
        if not self.core.execute:
            self.comm.all_to_all("expert", timing_zeros((pieces.size,), _F32), **kw)
            return None
        return self.comm.all_to_all("expert", np.ascontiguousarray(pieces, _F32).reshape(-1), **kw)

    @staticmethod
    def buffer_elements(moe: Any, tokens: int, width: int) -> int:
        """Elements of one dispatch (or combine) buffer per sequence of ``tokens``: the
        MoE's dispatch rows (``MoE.slots``: E x capacity, or T k dropless) of ``width``
        each; the all-to-all's input and output are each this large."""
        return int(moe.slots(int(tokens))) * int(width)

    def dispatch(self, tag: str, rows: np.ndarray, experts: int) -> np.ndarray:
        """(E R, C) token-side rows, expert-major -> (E/s s R, C) rows of this device's
        experts, each expert's rows from every position in turn."""
        s, c = self.shards, rows.shape[1]
        local, r = experts // s, rows.shape[0] // experts
        got = self._all_to_all(tag, rows)                                # (s, E/s, R, C)
        if got is None:
            return timing_zeros((local * s * r, c), _F32)
        return got.reshape(s, local, r, c).transpose(1, 0, 2, 3).reshape(-1, c)

    def combine(self, tag: str, rows: np.ndarray, experts: int) -> np.ndarray:
        """(E/s s R, C) expert outputs -> (E R, C): every expert's rows of this device's
        tokens."""
        s, c = self.shards, rows.shape[1]
        local = experts // s
        r = rows.shape[0] // (local * s)
        if self.core.execute:
            rows = rows.reshape(local, s, r, c).transpose(1, 0, 2, 3)   # piece j for position j
        got = self._all_to_all(tag, rows)                                # (s, E/s, R, C)
        if got is None:
            return timing_zeros((experts * r, c), _F32)
        return got.reshape(-1, c)
