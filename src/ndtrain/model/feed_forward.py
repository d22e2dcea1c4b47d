"""The dense SwiGLU feed-forward, in its own module because both the decoder block (model/llama.py)
and the mixture-of-experts layer (model/moe.py, its shared experts) build on it; with it in
either of them the two would import each other."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.model.linear import Linear


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=False)
        self.w2 = Linear(hidden, dim, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
