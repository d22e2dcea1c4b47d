"""A pipeline rank's dry run: what its neighbour stages would send it (compat/fake.py's
`pipeline_neighbours` asks here).

Every stage boundary carries the same tensor: the hidden states a block returns, as the stage
before hands them on. Its metadata (shape, strides, dtype, DTensor placements under TP) is
learnt by building, beside this rank's stages, a stand-in for the first stage: the embedding
and one block, through the same `parallelize`, on fake tensors, run once on a micro-batch of
the step's shape. The dry run does not count that stand-in (a shadow of the watch): no rank runs it.
"""

from __future__ import annotations

import torch


class Neighbours:
    """Answers a stage's question "what does the stage before send me?" for one dry run."""

    def __init__(self, state, enter_shadow, leave_shadow):
        self.state = state
        self._enter, self._leave = enter_shadow, leave_shadow
        self._metas = None
        self.micro_shape: tuple[int, int] | None = None  # (rows, sequence) of one micro-batch
        run = state.pipeline.run

        def watched_run(inputs, targets, micro_batch, train=True):
            rows, seq = targets.shape[0], targets.shape[1]
            self.micro_shape = (rows // state.pipeline.microbatches(rows, micro_batch), seq)
            return run(inputs, targets, micro_batch, train)

        state.pipeline.run = watched_run  # on this instance only: the step calls it as always

    def forward_metas(self, stage) -> tuple:
        if self._metas is None:
            self._metas = self._probe()
        return self._metas

    def _probe(self) -> tuple:
        from ndtrain.compat.torch import require
        from ndtrain.model.init import materialize
        from ndtrain.parallel.compose import parallelize
        from ndtrain.parallel.pipeline import build_stage_module

        state, cfg = self.state, self.state.cfg
        self._enter()
        try:
            part = parallelize(build_stage_module(cfg.model, [0], True, False), state.layout, state.mesh)
            materialize(part, cfg.train.seed, state.rt.device)
            rows, seq = self.micro_shape
            positions = state.cp_positions if state.cp_positions is not None else torch.arange(seq)
            with torch.enable_grad():
                out = part(torch.zeros(rows, seq, dtype=torch.int64), positions)
            return (require("stage_tensor_meta")(out),)
        finally:
            self._leave()



def neighbours_answered(state, watch):
    """A context in which this rank's pipeline stages (if any) hear from their neighbours."""
    import contextlib

    from ndtrain.compat.fake import pipeline_neighbours
    from ndtrain.tools.dryrun_watch import enter_shadow, leave_shadow

    if state.pipeline is None:
        return contextlib.nullcontext()
    return pipeline_neighbours(Neighbours(state, lambda: enter_shadow(watch), lambda: leave_shadow(watch)).forward_metas)
