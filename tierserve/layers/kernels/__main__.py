"""`python -m tierserve.layers.kernels`: build the CPU kernels for this machine (make does)."""

import logging
import sys

from tierserve.errors import TierserveError
from tierserve.layers.kernels import build

logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    print(build())
except TierserveError as err:
    print(f"error: {err.message}", file=sys.stderr)
    sys.exit(2)
