"""Reading a checkpoint's tensors without running code from its files.

DCP stores its `.metadata` and small non-tensor values (optimizer hyper-parameters) with pickle;
both are read here through allow-lists (a restricted unpickler, `torch.load(weights_only=True)`),
so a tampered or foreign file is rejected with one line instead of executed.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from ndtrain.compat.torch import dcp_metadata_allowlist, dcp_set_element
from ndtrain.errors import NdtrainError
from ndtrain.train.checkpoint.store import checkpoint_config, read_train_state, verify_checkpoint

_DCP_CLASSES = dcp_metadata_allowlist()  # DCP's classes, private ones included: compat.torch


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"disallowed object {module}.{name}")


def read_dcp_metadata(ckpt: Path):
    """DCP's `.metadata` through the allow-list; anything else is one NdtrainError line (torch's
    own loader would log a traceback per attempt before failing)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(ckpt) / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except OSError as exc:
        raise NdtrainError(f"{path}: cannot read checkpoint metadata: {exc.strerror}") from None
    except Exception as exc:  # a hostile or damaged pickle can raise almost anything
        raise NdtrainError(f"{path}: refused to read checkpoint metadata ({type(exc).__name__}: {exc}); the file "
                           f"is corrupt or was not written by torch.distributed.checkpoint") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise NdtrainError(f"{path}: refused to read checkpoint metadata (it holds a {type(metadata).__name__}, not "
                           f"DCP Metadata); the file was not written by torch.distributed.checkpoint")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read through an allow-list instead of plain pickle
    (and read once: dcp_load checks it before DCP sees it)."""

    def __init__(self, path, metadata=None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        metadata = self._metadata if self._metadata is not None else read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_tensor_shapes(ckpt: Path, expected: dict, metadata=None, prefix: str = "model.") -> None:
    """Refuses a checkpoint whose recorded model (train_state.json) disagrees with its tensors:
    `expected` maps names to the shapes that model has."""
    stored = (metadata or read_dcp_metadata(ckpt)).state_dict_metadata
    for name, shape in expected.items():
        meta = stored.get(prefix + name)
        if meta is None:
            raise NdtrainError(f"checkpoint {ckpt}: its recorded model has {name} but no such tensor is stored; "
                               f"train_state.json and the tensors disagree")
        size = list(getattr(meta, "size", []) or [])
        if size != list(shape):
            raise NdtrainError(f"checkpoint {ckpt}: its recorded model gives {name} the shape {list(shape)} but the "
                               f"stored tensor has {size}; train_state.json and the tensors disagree")


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (optimizer hyper-parameters) are plain numbers and tuples: load them
    with weights_only=True instead of DCP's default full unpickling."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            dcp_set_element()(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_load(state: dict, ckpt: Path, no_dist: bool = False, process_group=None) -> None:
    """Loads `state` in place from `ckpt`; `process_group`: where DCP's collectives run (None:
    the default group; the checkpointer passes its own, timed for file I/O)."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    metadata = read_dcp_metadata(ckpt)  # before DCP: its loader logs tracebacks on a bad file
    model = state.get("model")
    if isinstance(model, dict):
        check_tensor_shapes(ckpt, {k: tuple(v.shape) for k, v in model.items() if hasattr(v, "shape")}, metadata)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when loading without a process group
            dcp.load(state, storage_reader=SafeReader(str(ckpt), metadata), planner=SafeLoadPlanner(), no_dist=no_dist,
                     process_group=process_group)
    except NdtrainError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps per-rank failures: keep one line
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        ours = next((line for line in lines if "refused to read checkpoint metadata" in line), None)
        if ours:
            start = ours.find(str(Path(ckpt)))
            raise NdtrainError(ours[max(start, 0):].split("; rank local")[0]) from None
        detail = next((line for line in lines if "Error" in line or "mismatch" in line.lower()),
                      lines[0] if lines else "")
        raise NdtrainError(f"cannot load {ckpt}: {type(exc).__name__}: {detail[:300]}") from None


def load_model_weights(ckpt: Path, check: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Consolidated model weights of a checkpoint, in this process (no process group), whatever
    layout saved it; plus its train_state."""
    from ndtrain.model.llama import build_model

    ckpt = Path(ckpt)
    problem = verify_checkpoint(ckpt, check_hashes=check)
    if problem:
        raise NdtrainError(f"checkpoint {ckpt} is not usable: {problem}")
    state = read_train_state(ckpt)
    cfg = checkpoint_config(ckpt, state)
    model = build_model(cfg.model, "cpu")
    sd = {"model": model.state_dict()}
    dcp_load(sd, ckpt, no_dist=True)
    return {k: v.detach().clone() for k, v in sd["model"].items()}, state
