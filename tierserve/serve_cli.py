"""`tierserve serve`: engine flags (shared with `LLM(**kwargs)`) plus where to listen."""

from __future__ import annotations

import argparse

from tierserve.config import EngineArgs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def run(ns: argparse.Namespace) -> int:
    from tierserve.engine.llm import LLM
    from tierserve.sampling_params import SamplingParams

    args = EngineArgs.from_cli(ns)
    llm = LLM(**vars(args))
    print(f"loaded {llm.engine.args.model or 'the bundled demo model'}; HTTP server: not yet built")
    for delta in llm.generate_stream("ROMEO:", SamplingParams(max_tokens=64, temperature=0.8)):
        print(delta, end="", flush=True)
    print()
    return 0
