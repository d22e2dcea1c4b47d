"""Checkpoints: sharded, layout-independent, atomic, async (docs/checkpoints.md).

One room per job:

- manager.py    the Checkpointer: saves, publishes, resumes and loads a mapping of state
                objects, its collectives on a process group timed for file I/O.
- failure.py    what a failed write says, in one line.
- resume.py     which checkpoint a resume loads, whether it fits this run, which timeline follows.
- retention.py  what stays in a checkpoints directory: retention, clean-up, moving aside.
- state.py      the state objects a checkpoint is made of, and how they map onto its files.
- store.py      the on-disk format (names, marker, manifest, train_state.json, the tokenizer file
                it carries) and its checks.
- reader.py     reading a checkpoint's tensors without running code from its files.
- digest.py     who hashes what (shards as they are written), so publishing and verifying scale
                with the number of ranks and no save reads back a checkpoint.
- staging.py    how an async save copies the state into host memory, per device.

The collectives they use (barrier, broadcast_object, gather_objects, any_rank) are
train/distributed.py's. Code outside the package imports the names below from here.
"""

from ndtrain.train.checkpoint.manager import Checkpointer, data_fingerprint
from ndtrain.train.checkpoint.reader import dcp_load, load_model_weights
from ndtrain.train.checkpoint.state import DiLoCoState, ModelState, OptimizerState, RNGState, TrainProgress
from ndtrain.train.checkpoint.store import (CHECKPOINT_FORMAT, MANIFEST, MARKER, TOKENIZER, TRAIN_STATE,
                                            checkpoint_config, fsync_dir, list_checkpoints, manifest_items,
                                            model_mismatch, not_a_directory, read_train_state, step_name, step_of,
                                            verify_checkpoint, write_manifest, write_marker)

__all__ = ["Checkpointer", "data_fingerprint", "DiLoCoState", "ModelState", "OptimizerState", "RNGState",
           "TrainProgress", "CHECKPOINT_FORMAT", "MANIFEST", "MARKER", "TOKENIZER", "TRAIN_STATE",
           "checkpoint_config", "dcp_load", "fsync_dir", "list_checkpoints", "load_model_weights", "manifest_items",
           "model_mismatch", "not_a_directory",
           "read_train_state", "step_name", "step_of", "verify_checkpoint", "write_manifest", "write_marker"]
