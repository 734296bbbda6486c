"""Trained parameters out of a checkpoint, in a format other tools read: safetensors.

``tpu-pod export CHECKPOINT --format safetensors`` writes the parameters (and
the non-trainable model state, e.g. BatchNorm's moving averages, the mean over
replicas) of a checkpoint as one ``.safetensors`` file: a JSON header of
names, dtypes and shapes, then the raw little-endian bytes (Hugging Face's
format; no pickle, so loading it cannot run code).
``safetensors.numpy.load_file`` reads it back as numpy arrays with the
checkpoint's names (``dense1/kernel``, ...). The file's metadata holds the
scenario name, the model and the step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from pod.errors import CheckpointError
from pod.safe_io import write_atomic
from pod.state.checkpoint import Checkpoint, latest_checkpoint, load_checkpoint

__all__ = ["EXPORT_FORMATS", "read_checkpoint", "export_safetensors"]

EXPORT_FORMATS = ("safetensors",)


def read_checkpoint(path: Path, warn: Callable[[str], None] | None = None) -> Checkpoint:
    """A checkpoint file, or the newest valid checkpoint of a directory.

    Raises:
        CheckpointError: no valid checkpoint there; one line naming the path.
    """
    path = Path(path)
    if path.is_dir():
        ckpt = latest_checkpoint(path, warn=warn)
        if ckpt is None:
            raise CheckpointError(f"{path}: no valid checkpoint (ckpt-<step>.msgpack) here")
        return ckpt
    return load_checkpoint(path)


def export_safetensors(ckpt: Checkpoint, output: Path, *,
                       optimizer_state: bool = False) -> dict[str, tuple[int, ...]]:
    """Write a checkpoint's parameters (and model state) as a safetensors file.

    Args:
        ckpt: a checkpoint (``read_checkpoint``).
        output: the ``.safetensors`` file to write (its directory is created);
            written whole or not at all (``pod.safe_io.write_atomic``: a fresh
            temporary name, never a fixed one another user could plant a link at).
        optimizer_state: also write the optimizer's slots, under ``optimizer/<name>``.

    Returns:
        Name -> shape of every tensor written.

    Raises:
        CheckpointError: a name appears both as a parameter and as model state.
        OutputError: the file system refused; one line naming the path.
    """
    from safetensors.numpy import save

    tensors: dict[str, np.ndarray] = {}
    groups = [ckpt.params, ckpt.model_state]
    if optimizer_state:
        groups.append({f"optimizer/{k}": v for k, v in ckpt.optimizer_state.items()})
    for group in groups:
        for name, array in group.items():
            if name in tensors:
                raise CheckpointError(f"{name}: in the checkpoint twice (parameter and state)")
            tensors[name] = np.ascontiguousarray(array)
    scenario = ckpt.scenario or {}
    metadata = {"format": "np", "step": str(ckpt.step),
                "scenario": str(scenario.get("name", "")),
                "model": str((scenario.get("model") or {}).get("name", ""))}
    data = save(tensors, metadata=metadata)
    write_atomic(Path(output), lambda f: f.write(data), binary=True, make_parents=True)
    return {name: tuple(a.shape) for name, a in tensors.items()}
