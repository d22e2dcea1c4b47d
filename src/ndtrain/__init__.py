"""ndtrain: n-dimensional parallel training for Llama-family language models on torch.distributed."""

__version__ = "0.1.0"
