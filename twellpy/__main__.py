"""``python -m twellpy``: the command line (see :mod:`twellpy.cli`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
