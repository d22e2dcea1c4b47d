"""Checkpoints: sharded, layout-independent, atomic, async (docs/checkpoints.md).

The rooms, each with one job:

- store.py: the on-disk format (names, marker, manifest, train_state.json) and how it is checked.
- digest.py: who hashes what, so publishing and verifying scale with the number of ranks.
- manager.py: the Checkpointer, which saves, publishes and loads a mapping of state objects.
- resume.py: which checkpoint a resume loads.
- retention.py: what stays in a checkpoints directory, and timelines.
- state.py: the state objects a checkpoint is made of.
- staging.py: how an async save copies the state into host memory.

Code outside the package imports from here; the names below are the package's public face.
"""

from ndtrain.train.checkpoint.manager import Checkpointer, data_fingerprint
from ndtrain.train.checkpoint.state import DiLoCoState, ModelState, OptimizerState, RNGState, TrainProgress
from ndtrain.train.checkpoint.store import (FORMAT, MANIFEST, MARKER, MODEL_KEYS, TRAIN_STATE, checkpoint_config,
                                            dcp_load, fsync_dir, list_checkpoints, load_model_weights,
                                            model_mismatch, not_a_directory, read_train_state, step_name, step_of,
                                            verify, write_manifest, write_marker)

__all__ = ["Checkpointer", "data_fingerprint", "DiLoCoState", "ModelState", "OptimizerState", "RNGState",
           "TrainProgress", "FORMAT", "MANIFEST", "MARKER", "MODEL_KEYS", "TRAIN_STATE", "checkpoint_config",
           "dcp_load", "fsync_dir", "list_checkpoints", "load_model_weights", "model_mismatch", "not_a_directory",
           "read_train_state", "step_name", "step_of", "verify", "write_manifest", "write_marker"]
