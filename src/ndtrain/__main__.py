"""Allows `python -m ndtrain ...` and `torchrun -m ndtrain train ...`."""

import sys

from ndtrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
