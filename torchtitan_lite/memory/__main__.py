"""``python -m torchtitan_lite.memory``: see :mod:`torchtitan_lite.memory.cli`."""

import sys

from torchtitan_lite.memory.cli import main

sys.exit(main())
