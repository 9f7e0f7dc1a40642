"""One grammar compile process of the server's compile pool (frontend/grammar_pool.py).

xgrammar's compile threads cannot be stopped, and a hostile grammar can compile for minutes; a
process can be ended. The pool starts this as `python -m tierserve.server.grammar_worker`, sends
a WorkerSetup (where the server's tokenizer is), then one CompileJob per line; each answer is one
CompileResult line, the compiled grammar in xgrammar's serialised form. It ends when its stdin
closes (the server left) or when the pool kills it (a client that left, a compile past its time).

The worker reads the tokenizer and makes xgrammar's view of it itself: the API process never
imports xgrammar, which brings torch (2.5 s of the first structured output's wait, and the
memory of a torch the API process has no other use for).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import BinaryIO

READY = b"ready\n"
# Tests hold a compile in its worker through this file, as STEP_HOLD_ENV holds a step: while it
# exists, a worker that took a job waits before compiling, after writing FILE.held.PID.
COMPILE_HOLD_ENV = "TIERSERVE_TEST_COMPILE_HOLD"
# Seconds one compile may take before the pool ends its process (`--grammar-compile-timeout`).
DEFAULT_COMPILE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker compiles for: the tokenizer's directory, the model's vocabulary size (its
    logits' width) and the tokens that end a grammar's output."""

    tokenizer: str
    vocab_size: int
    stop_ids: tuple[int, ...]

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> WorkerSetup:
        fields = json.loads(line)
        return cls(fields["tokenizer"], fields["vocab_size"], tuple(fields["stop_ids"]))


@dataclass(frozen=True)
class CompileJob:
    kind: str
    source: str

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> CompileJob:
        return cls(**json.loads(line))


@dataclass(frozen=True)
class CompileResult:
    compiled: str | None = None  # xgrammar's CompiledGrammar.serialize_json()
    error: str | None = None  # the user's error: the grammar does not compile

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> CompileResult:
        return cls(**json.loads(line))


def serve(requests: BinaryIO, replies: BinaryIO) -> int:
    from tierserve.errors import TierserveError
    from tierserve.frontend.grammar import compile_spec, new_compiler, tokenizer_info
    from tierserve.frontend.tokenizer import load_tokenizer
    from tierserve.sampling_params import StructuredOutput

    setup = WorkerSetup.decode(requests.readline())
    try:  # the tokenizer is only read here: xgrammar's view keeps the vocabulary it needs
        info = tokenizer_info(load_tokenizer(setup.tokenizer), setup.vocab_size, setup.stop_ids)
    except TierserveError as err:  # one line in the server's log; the pool sees it exit
        print(f"grammar compile worker: {err.message}", file=sys.stderr)
        return 1
    compiler = new_compiler(info)
    replies.write(READY)
    replies.flush()
    for line in requests:
        job = CompileJob.decode(line)
        _test_hold()
        try:
            spec = StructuredOutput(job.kind, job.source)
            result = CompileResult(compiled=compile_spec(compiler, spec).serialize_json())
        except TierserveError as err:
            result = CompileResult(error=err.message)
        replies.write(result.encode())
        replies.flush()
    return 0


def _test_hold() -> None:
    from tierserve.utils import wait_while_held

    hold = os.environ.get(COMPILE_HOLD_ENV)
    wait_while_held(hold, f"{hold}.held.{os.getpid()}")


def main() -> int:
    # Replies go to the pipe that was stdout; anything a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    sys.exit(main())
