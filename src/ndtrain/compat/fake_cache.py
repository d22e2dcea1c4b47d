"""A cheaper hit in FakeTensorMode's dispatch cache, for the dry run's fake mode (compat/fake.py).

A dry run dispatches every operator of a whole step to fake tensors: ~1.7 million for the 70B
rank, nearly all of them hits in torch's cache (an output's metadata kept per operator and
input metadata). torch spends most of a hit outside the cache itself: its key describes each
input tensor through a dataclass of 17 fields flattened one by one (three sparsity probes, a
memory-format probe), and it rebuilds the output through two context managers and generators
per output. Here, on one mode instance, and only where nothing is symbolic:
- the key's part for each input is one tuple of the same metadata (the memory format left out:
  the shape, strides and layout decide it), behind a marker torch's own key never holds, so the
  two kinds of key cannot meet; anything else (a SymInt, a tensor of another mode, a constant,
  a type not listed) is keyed by torch's code as before;
- a cached output is made as torch makes it (an empty meta tensor of the cached shape and
  strides inside torch's own kernel-invocation guard, the view's storage set, wrapped in a
  FakeTensor), in one pass.
What is cached, when, and what a hit returns stay torch's: the same figures, fewer Python calls.
Each torch method replaced is probed first by its signature; one that differs (or is missing)
keeps torch's own, slower and the same."""

from __future__ import annotations

import dataclasses
import inspect

from ndtrain.compat.torch import find

# The signatures the replacements were written against (torch 2.13's).
_PREP = ["self", "result", "args", "state", "id_hashed_objects"]
_OUTPUT = ["self", "state", "entry", "key", "func", "args"]
# The fields of torch's TensorMetadata this key describes, in the order `describe` lists them;
# the rest are decided by a strided tensor's shape, strides and layout. A torch whose metadata has
# a field in neither keeps its own key.
DESCRIBED = ("dtype", "shape", "stride", "device", "storage_offset", "storage_bytes", "requires_grad",
             "is_quantized", "is_conj", "is_neg", "is_inference")
IMPLIED = ("layout", "memory_format", "is_sparse", "is_coalesced", "dense_dim", "sparse_dim")


class _TorchKeys(Exception):
    """An argument this key does not describe: torch's key describes the whole argument list."""


class _TorchOutput(Exception):
    """A cached output this code does not make: torch's code makes every output of the call."""


class _Marker:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<ndtrain fake cache key>"


_MARK = _Marker()


def _signature(fn) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def quicken(mode) -> None:
    """Installs the cheaper key and output on this FakeTensorMode instance (nothing else sees them)."""
    import torch

    fake = find("fake_tensor")
    prep, output, guard = find("fake_cache_key_args"), find("fake_cache_output"), find("fake_kernel_invocation")
    plain = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                       torch.memory_format))
    sequences = frozenset((list, tuple, torch.Size))
    strided = torch.strided

    def describe(out: list, args) -> None:
        for a in args:
            kind = type(a)
            if kind is fake:
                # (no shape environment: this mode's tensors have no symbolic sizes)
                if a.fake_mode is not mode or a.constant is not None or a.layout is not strided:
                    raise _TorchKeys
                out.append((a.dtype, tuple(a.shape), a.stride(), a.device, a.storage_offset(),
                            a.untyped_storage().nbytes(), a.requires_grad, a.is_quantized, a.is_conj(),
                            a.is_neg(), a.is_inference()))
            elif kind in plain:
                out += (kind, a)  # the type too: 1 and 1.0 hash alike and make different dtypes
            elif kind in sequences:
                out += (kind, len(a))
                describe(out, a)
            else:
                raise _TorchKeys

    metadata = find("fake_tensor_metadata")
    fields = {f.name for f in dataclasses.fields(metadata)} if metadata is not None else None
    if (prep is not None and fake is not None and _signature(prep) == _PREP
            and fields is not None and fields <= set(DESCRIBED + IMPLIED)):
        torchs_prep = mode._prep_args_for_hash

        def prep_args_for_hash(result: list, args, state, id_hashed_objects: list) -> None:
            if mode.shape_env is not None:
                return torchs_prep(result, args, state, id_hashed_objects)
            key = [_MARK, type(args)]
            try:
                if type(args) is dict:
                    key.append(tuple(args))
                    describe(key, args.values())
                else:
                    describe(key, args)
            except _TorchKeys:
                return torchs_prep(result, args, state, id_hashed_objects)
            key.append(_MARK)
            result += key

        mode._prep_args_for_hash = prep_args_for_hash

    if output is not None and guard is not None and fake is not None and _signature(output) == _OUTPUT:
        torchs_output = mode._output_from_cache_entry
        empty_strided = torch.empty_strided

        def one(info, args):
            if info.inplace_idx is not None:  # an in-place operator returns its argument
                return args[info.inplace_idx]
            meta = info.metadata
            if meta is None:
                return info.constant_value
            if meta.is_conj or meta.is_neg:
                raise _TorchOutput
            with guard(mode):
                empty = empty_strided(meta.shape, meta.stride, dtype=meta.dtype, layout=meta.layout,
                                      device="meta", requires_grad=meta.requires_grad)
                if info.view_idx is not None:  # a view shares its input's storage
                    empty.set_(args[info.view_idx].untyped_storage(), meta.storage_offset, meta.shape,
                               meta.stride)
            return fake(mode, empty, meta.device)

        def output_from_cache_entry(state, entry, key, func, args):
            if mode.shape_env is None:
                try:
                    if entry.is_output_tuple:
                        return tuple([one(info, args) for info in entry.output_infos])
                    return one(entry.output_infos[0], args)
                except _TorchOutput:  # a conjugate or negative view: torch sets its bits
                    pass
            return torchs_output(state, entry, key, func, args)

        mode._output_from_cache_entry = output_from_cache_entry
