"""How an async checkpoint copies the training state into host memory ("staging"), per device.

CUDA: pinned and shared host memory (DCP's defaults: pinned pages copy at full PCIe/NVLink-C2C
speed, and shared memory is what a process-based writer reads without another copy), copied with
non-blocking copies on a side stream from a background thread. The step then pays for almost
nothing at the save; the copy overlaps the next forward and backward, and the trainer waits for
it (Checkpointer.wait_for_staging) only before the optimizer next writes the weights. Unpinned
blocking staging stalled every save for seconds at 8B.

Elsewhere (CPU ranks on Gloo): plain blocking copies, which is what is known to work there:
pinning needs CUDA, non-blocking copies need an accelerator, and a staging thread would compete
with training for the same few cores.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ndtrain.compat.torch import order_staging_after_caller


def staging_options(device) -> StagingOptions:
    """The staging a run on `device` uses (a torch.device or its name)."""
    cuda = torch.device(device).type == "cuda"
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=cuda, use_async_staging=cuda,
                          use_non_blocking_copy=cuda)


class OrderedStager(DefaultStager):
    """DefaultStager whose side stream first waits for the work already queued on the caller's
    stream. DefaultStager copies on a stream of its own without that ordering, so the copy could
    read weights the optimizer step (queued on the compute stream just before the save) had not
    finished writing."""

    def stage(self, state_dict, **kwargs):
        order_staging_after_caller(self)  # DefaultStager's own stream is private torch: compat.torch
        return super().stage(state_dict, **kwargs)


def make_stager(device, options: StagingOptions | None = None) -> OrderedStager:
    return OrderedStager(options or staging_options(device))


def split_response(response):
    """dcp.async_save's answer as (staging future or None, upload future): with async staging it
    is an AsyncSaveResponse of both, otherwise the upload future alone."""
    staged = getattr(response, "staging_completion", None)
    return staged, getattr(response, "upload_completion", response)
