"""Compatibility with the libraries ndtrain builds on. `compat.torch` is the one door to torch's
private names (docs/torch-compat.md): nothing else in ndtrain imports or reads them."""
