"""A tensor-parallel rank other than 0: builds its engine (its shard of the model, its pools)
and runs the steps rank 0 announces until told to stop. Started by distributed/ranks.py as
`python -m tierserve.engine.worker`; it dies with that process (distributed/rank_env.py).
"""

from __future__ import annotations

import os
import signal

from tierserve.distributed import ENV_ARGS, die_with_parent, exit_after


def main() -> int:
    die_with_parent()  # first: the parent may already be gone, or go while torch loads
    # A terminal's Ctrl-C reaches the whole process group: rank 0 stops this rank in order
    # once the server has drained (and it dies with rank 0 in any case).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import json
    import logging

    from tierserve.args import EngineArgs
    from tierserve.engine.engine import Engine
    from tierserve.errors import TierserveError

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(message)s")
    args = EngineArgs(**json.loads(os.environ[ENV_ARGS]))
    try:
        engine = Engine(args)
    except TierserveError:
        return 2  # rank 0 refused the start-up and says why
    engine.follow()
    return 0


if __name__ == "__main__":
    exit_after(main())
