"""``python -m torchtitan_lite.estimate``: the earlier name of ``python -m torchtitan_lite.memory``
(:mod:`torchtitan_lite.memory.cli`), kept so that existing commands keep working."""

import sys

from torchtitan_lite.memory.cli import main

if __name__ == "__main__":
    sys.exit(main())
