"""The embedding under tensor parallel (parallel/tensor.py VocabParallelEmbedding): each tp rank's
backward builds the gradient of its own vocabulary rows only. torch's DTensor embedding
(RowwiseParallel) built the whole vocabulary's on every rank (llama3-405b, tp 8: 11.7 GiB of
temporaries on the first pipeline stage). Parity with one process is tests/parallel/test_parity.py's
tp layouts."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _EmbeddingBackwardRows(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.rows.append(out.shape[0])
        return out


def _rank(tokens, sp: bool):
    from ndtrain.config import load_config
    from ndtrain.model.init import materialize
    from ndtrain.model.llama import build_model
    from ndtrain.parallel import dims as pdims
    from ndtrain.parallel.compose import parallelize

    cfg = load_config(None, {"model": {"preset": "debug", "vocab_size": 250}, "data": {"seq_len": tokens.shape[1]},
                             "parallel": {"dp_shard": 1, "tp": 2, "sequence_parallel": sp}})
    dims = pdims.checked_layout(cfg.parallel, 2, cfg.model, tokens.shape[1], data=cfg.data)
    model = materialize(parallelize(build_model(cfg.model, "meta"), dims, pdims.build_mesh(dims, "cpu")), 0, "cpu")
    loss = model(tokens).float().square().mean()
    with _EmbeddingBackwardRows() as seen:
        loss.backward()
    weight = model.tok_embeddings.weight
    return seen.rows, weight.to_local().shape[0], weight.grad.to_local().shape[0], cfg.model.vocab_size


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sp", [True, False])
def test_each_tp_rank_builds_its_own_rows_gradient(sp, hang_deadline):
    from ndtrain.parallel.launch import run_ranks

    # 250 rows over 2 ranks: 125 each; every token id on both sides of the split
    tokens = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(5))
    for rows, local, grad_rows, vocab in run_ranks(2, _rank, tokens, sp, timeout_s=hang_deadline(120)):
        assert local == vocab // 2 and grad_rows == local
        assert rows == [local], rows  # one backward, of this rank's rows (the whole vocabulary before)
