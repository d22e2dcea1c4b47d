"""Sampling text from a checkpoint, in one process, whatever layout saved it: on the run's device,
with a KV cache (the prompt is prefilled once, then each new token is one single-token forward).

The cache plugs into the model through `Attention.sdpa`, the slot context parallelism uses for
ring attention, so the model itself carries no sampling code. The no-cache path (`cache=False`)
is kept as the reference the tests compare against: both see the same window of tokens.

torch, the model and the checkpoint package are imported inside the functions that use them, so
`ndtrain generate` refuses a bad argument or a missing checkpoint path before importing torch
(about a thousand modules: seconds on a slow CPU)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING

from ndtrain.data.tokenizer import load_tokenizer
from ndtrain.errors import NdtrainError, UsageError
from ndtrain.model.config import ModelConfig, num_params
from ndtrain.train import host_memory

if TYPE_CHECKING:
    import torch

    from ndtrain.model.llama import Transformer

# Bytes per parameter and per cached K/V element: checkpoints hold fp32 weights and the sample
# runs in them.
_FP32 = 4
# Of the free memory the sample may use: on a GPU the allocator's fragmentation and the kernels'
# workspaces; on the host, other ranks of the node may still be exiting.
_DEVICE_SHARE, _HOST_SHARE = 0.9, 0.5


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory, a `checkpoints/` directory or a run directory."""
    path = Path(path)
    if not path.exists():
        raise NdtrainError(f"{path}: no such checkpoint, checkpoints/ or run directory")
    from ndtrain.train.checkpoint import list_checkpoints, not_a_directory

    if not path.is_dir():
        raise NdtrainError(f"{path}: {not_a_directory(path)}")
    if (path / "train_state.json").exists():
        return path
    for root in (path, path / "checkpoints"):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise NdtrainError(f"no checkpoint found at {path} (no step_XXXXXXXX/ with a COMPLETE marker, nor checkpoints/)")


def sample_device(device: str | torch.device = "auto") -> torch.device:
    import torch

    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available")
    return device


def memory_needed(cfg: ModelConfig, tokens: int) -> int:
    """Bytes the sample holds: fp32 weights plus the K/V cache for `tokens` positions (at most
    the context); activations of one window are small beside either."""
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * min(tokens, cfg.max_seq_len) * _FP32
    return num_params(cfg) * _FP32 + kv


def does_not_fit(cfg: ModelConfig, device: torch.device, tokens: int) -> str | None:
    """Why a sample of `tokens` positions would not fit `device` (None: it fits). The weights
    are read onto the device tensor by tensor, so the host holds only one at a time."""
    import torch

    need = memory_needed(cfg, tokens)
    gc.collect()  # the trainer that just finished may still hold its model and optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, where = int(torch.cuda.mem_get_info(device)[0] * _DEVICE_SHARE), f"{device}"
    else:
        free, where = host_memory.available_bytes(), "host memory"
        if free is None:
            return None
        free = int(free * _HOST_SHARE)
    if need > free:
        return f"needs {need / 2**30:.1f} GiB (fp32 weights + K/V cache), {where} has {free / 2**30:.1f} GiB to spare"
    return None


# A live run's retention removes its older checkpoints, the one being read among them: a reader
# of a run or checkpoints/ directory then takes the newest again, this many times at most.
_RELOADS = 5


def _published(ckpt: Path) -> bool:
    from ndtrain.train.checkpoint import MARKER

    return (Path(ckpt) / MARKER).is_file()


def _load_one(ckpt: Path, device, verified: bool, tokenizer: bool) -> tuple:
    import torch

    from ndtrain.model.llama import build_model
    from ndtrain.train.checkpoint import checkpoint_config, dcp_load, read_train_state, verify_checkpoint

    problem = verify_checkpoint(ckpt, check_hashes=not verified)
    if problem:
        raise NdtrainError(f"checkpoint {ckpt} is not usable: {problem}")
    state = read_train_state(ckpt)
    cfg = checkpoint_config(ckpt, state)
    tok = (checkpoint_tokenizer(cfg, state, ckpt),) if tokenizer else ()  # before the weights: fail fast
    model = build_model(cfg.model, "meta")
    model.to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():
        dcp_load({"model": model.state_dict()}, ckpt, no_dist=True)  # in place, shapes checked first
    model.eval()
    return (model, cfg, state, *tok)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    verified: bool = False, tokenizer: bool = False) -> tuple:
    """(model, config, train_state) of the checkpoint `path` names (the newest, for a run or
    checkpoints/ directory), and with `tokenizer` its tokenizer (checkpoint_tokenizer), read from
    the same checkpoint. Once read, the model is in memory: what retention does next is no
    concern. A checkpoint retention removed while it was being read (it lost its marker) is not
    bad input: for a directory the newest one is read instead; a checkpoint named itself is gone,
    said in one line with exit code 1 (RunError)."""
    from ndtrain.errors import RunError

    for _ in range(_RELOADS):
        ckpt = resolve_checkpoint(path)
        try:
            return _load_one(ckpt, device, verified, tokenizer)
        except (NdtrainError, OSError):
            if _published(ckpt):
                raise  # still there: the checkpoint itself is at fault
            if ckpt == Path(path):  # named itself: there is nothing newer to take
                break
    raise RunError(f"{ckpt}: removed while it was read (a running job's retention keeps only its newest "
                   f"checkpoints); name the run or its checkpoints/ directory to read the newest")


def load_model(path: str | Path, device: str | torch.device = "cpu", verified: bool = False,
               state: bool = False, tokenizer: bool = False) -> tuple:
    """The checkpoint's model on `device`, read straight into the device's tensors (one copy),
    and its config (then its train_state, with `state`, and its tokenizer, with `tokenizer`).
    `verified`: the caller has just hashed this checkpoint (it published it), so only the
    manifest and sizes are checked, not every byte again. See load_checkpoint for a checkpoint
    that retention removes while it is read."""
    out = load_checkpoint(path, device, verified, tokenizer)
    return out if state else (*out[:2], *out[3:])


def _recorded(data, key: str):
    """A field of a checkpoint's data fingerprint (a mixture's first component: the components
    share one tokenizer)."""
    while isinstance(data, dict) and isinstance(data.get("mix"), list) and data["mix"]:
        first = data["mix"][0]
        data = first[2] if isinstance(first, list) and len(first) == 3 else None
    return data.get(key) if isinstance(data, dict) else None


def recorded_tokenizer(state: dict) -> str | None:
    """The tokenizer a checkpoint's train_state names: "byte", "bpe", or None (an imported
    checkpoint records no data)."""
    return _recorded(state.get("data"), "tokenizer")


def checkpoint_tokenizer(cfg, state: dict, ckpt: Path | None = None):
    """The tokenizer of a checkpoint's model. The byte tokenizer needs no file: the checkpoint's
    data fingerprint names it, so such a checkpoint samples from any directory, on any machine.
    A BPE checkpoint `ckpt` carries its run's tokenizer.json (its manifest lists the file); one
    saved before checkpoints carried it has it read from the data directory the run trained on
    (recorded absolute)."""
    from ndtrain.data.mixture import first_data_dir
    from ndtrain.data.tokenizer import BPETokenizer, ByteTokenizer
    from ndtrain.train.checkpoint import TOKENIZER, manifest_items

    name = recorded_tokenizer(state)
    if name == "byte":
        return ByteTokenizer()
    if ckpt is not None and any(rel == TOKENIZER for rel, _, _ in manifest_items(ckpt)[0]):
        tok = BPETokenizer.load(ckpt)  # its SHA-256 is the manifest's (verify checks it)
        vocab = _recorded(state.get("data"), "vocab_size")
        if vocab is not None and tok.vocab_size != vocab:
            raise NdtrainError(f"{Path(ckpt) / TOKENIZER}: {tok.vocab_size} ids, but the checkpoint's data "
                               f"fingerprint records vocab_size {vocab}; the file does not belong to it")
        return tok
    held = f"{ckpt} holds no {TOKENIZER} (saved before checkpoints carried it) and " if ckpt is not None else ""
    try:
        return load_tokenizer(first_data_dir(cfg.data.path, cfg.data.mix))
    except NdtrainError as exc:
        raise NdtrainError(f"the checkpoint's {name + ' ' if name else ''}tokenizer: {held}the data the run "
                           f"trained on (data.path {cfg.data.path}) cannot give it: {exc}") from None


class KVCache:
    """One attention layer's keys and values so far, in a buffer sized once; called in place of
    the layer's attention kernel (`Attention.sdpa`) with the new tokens' q/k/v [b, h, s, d]."""

    def __init__(self, inner, capacity: int):
        self.inner, self.capacity = inner, capacity
        self.k = self.v = None
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        s, past = k.shape[2], self.length
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        if past + s > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {past} + {s} would not fit")
        self.k[:, :, past:past + s], self.v[:, :, past:past + s] = k, v
        self.length = past + s
        if past == 0:  # the prefill: the model's own kernel, exactly the no-cache computation
            return self.inner(q, k, v, **kwargs)
        if kwargs or s != 1:
            raise ValueError("a KV cache continues one token at a time, without document masks")
        import torch.nn.functional as F

        # The one new query sees every cached position: no mask. (is_causal would align the
        # mask to the first key, hiding all but position 0.)
        return F.scaled_dot_product_attention(q, self.k[:, :, :self.length], self.v[:, :, :self.length],
                                              enable_gqa=True)


def window_start(n_tokens: int, start: int, ctx: int) -> int:
    """The first of `n_tokens` the model sees, given the window began at `start`: the window
    grows to the context length, then restarts on its newest half, so a cache is refilled once
    per ctx/2 tokens instead of shifting every token. Both paths use this, so they match."""
    if n_tokens - start <= ctx:
        return start
    return n_tokens - max(1, ctx // 2)


def _choose(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    import torch

    logits = logits.float().cpu()  # on the host: the same seed gives the same tokens on any device
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


def sample(model: Transformer, tokens: list[int], n: int, temperature: float = 0.8, top_k: int = 40,
           seed: int = 0, stop_id: int | None = None, cache: bool = True) -> list[int]:
    """Up to n new tokens; stops after `stop_id` (the end of a document). `cache=False`
    recomputes the whole window for every token (the reference)."""
    import torch

    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        device = next(model.parameters()).device
        ctx = model.cfg.max_seq_len
        ids = list(tokens)
        caches = []
        if cache:
            capacity = min(ctx, len(ids) + n)
            for layer in model.layers.values():
                caches.append(KVCache(layer.attention.sdpa, capacity))
                layer.attention.sdpa = caches[-1]
        try:
            start, filled = 0, False  # filled: the cache holds ids[start:-1] (or all, before a token)
            for _ in range(n):
                new_start = window_start(len(ids), start, ctx)
                if not cache or new_start != start or not filled:
                    start = new_start
                    for c in caches:
                        c.reset()
                    x = torch.tensor([ids[start:]], device=device)
                    logits = model(x)[0, -1]
                    filled = True
                else:  # one token at its position in the window
                    x = torch.tensor([ids[-1:]], device=device)
                    logits = model(x, positions=torch.tensor([len(ids) - 1 - start], device=device))[0, -1]
                nxt = _choose(logits, temperature, top_k, gen)
                ids.append(nxt)
                if nxt == stop_id:
                    break
        finally:
            for layer, c in zip(model.layers.values(), caches):
                layer.attention.sdpa = c.inner
        return ids


def generate_from_checkpoint(path, prompt: str, n: int, temperature: float = 0.8, top_k: int = 40,
                             seed: int = 0, device: str | torch.device = "cpu", verified: bool = False) -> str:
    model, cfg, state, tok = load_model(path, sample_device(device), verified, state=True, tokenizer=True)
    out = sample(model, tok.encode(prompt), n, temperature, top_k, seed, getattr(tok, "eos_id", None))
    return tok.decode(out)

