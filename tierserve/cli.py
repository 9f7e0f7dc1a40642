"""`tierserve serve | plan | batch | bench`: one entry point; each subcommand lives in the module
that owns it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from tierserve.errors import TierserveError
from tierserve.utils import JSON_SCHEMA_VERSION, emit

# name -> (module path, help); each module defines add_arguments(parser) and run(ns) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tierserve.server.cli", "serve a model (OpenAI-compatible HTTP server)"),
    "plan": ("tierserve.plan.cli", "size the KV cache before launch (tierserve, SGLang, vLLM)"),
    "batch": (
        "tierserve.batch.runner",
        "run an OpenAI Batch file (resumable) against a server or model",
    ),
    "bench": ("tierserve.bench.cli", "benchmark a server with the field's workloads"),
}


def _load(module_path: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable]:
    import importlib

    module = importlib.import_module(module_path)
    return module.add_arguments, module.run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    runners = {}
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        add_arguments, run = _load(module_path)
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
        runners[name] = run
    ns = parser.parse_args(argv)
    try:
        return runners[ns.command](ns)
    except TierserveError as err:
        print(f"tierserve {ns.command}: error: {err.message}", file=sys.stderr)
        if getattr(ns, "json", False):  # a JSON reader gets its error as JSON too
            error = {"kind": "error", "field": err.field, "message": err.message}
            emit(json.dumps({"schema_version": JSON_SCHEMA_VERSION, **error}))
        return 2


if __name__ == "__main__":
    sys.exit(main())
