"""A tensor-parallel rank other than 0: builds its engine (its shard of the model, its pools)
and runs the steps rank 0 announces until told to stop. Started by distributed/ranks.py."""

from __future__ import annotations

import json
import logging
import os
import sys

from tierserve.config import EngineArgs
from tierserve.distributed.ranks import ENV_ARGS
from tierserve.errors import TierserveError


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(message)s")
    args = EngineArgs(**json.loads(os.environ[ENV_ARGS]))
    from tierserve.engine.engine import Engine

    try:
        engine = Engine(args)
    except TierserveError:
        return 2  # rank 0 refused the start-up and says why
    engine.follow()
    return 0


if __name__ == "__main__":
    sys.exit(main())
