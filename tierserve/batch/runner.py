"""`tierserve batch`: the OpenAI Batch file format, against a running server or in-process;
with `--regenerate`, a dataset of conversations answered again turn by turn (regenerate.py).

Output lines are appended as requests complete, so a run that is killed loses nothing it
finished: a rerun skips every `custom_id` that succeeded (and drops a torn last line). Lines
that failed are retried by a rerun, their old lines replaced, unless `--no-retry-failed`.
Transient failures (connection errors, 429, 5xx) are retried with backoff within a run; a request
the server rejects (4xx) is written with its error, as OpenAI's batch output does. The exit
status is 0 only when every input line has succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tierserve.args import EngineArgs
from tierserve.batch.job_usage import JobUsage
from tierserve.batch.jsonl import read_json_lines
from tierserve.batch.output_file import (
    check_output,
    drop_failed,
    output_lock,
    read_output,
    writable_output,
)
from tierserve.errors import TierserveError
from tierserve.utils import check_url

if TYPE_CHECKING:
    from tqdm import tqdm

RETRYABLE = {408, 429, 500, 502, 503, 504}
# What a batch line may ask for: OpenAI's batch endpoints that tierserve serves (its
# /v1/embeddings is not). A line is a path on the server --url names, sent by POST.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="OpenAI Batch input (.jsonl: custom_id, method, url, body)")
    parser.add_argument("-o", "--output", required=True, help="output .jsonl (appended, resumable)")
    parser.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--max-retries", type=int, default=5, help="within a run, per request")
    parser.add_argument(
        "--no-retry-failed",
        action="store_true",
        help="keep the failed lines of an earlier run instead of retrying them",
    )
    parser.add_argument("--no-progress", action="store_true")
    regen = parser.add_argument_group("--regenerate (EAGLE-3 data: a dataset's answers again)")
    regen.add_argument(
        "--regenerate",
        action="store_true",
        help="the input is conversations (ShareGPT `conversations` or OpenAI `messages`, "
        "optional `id`): replace every assistant turn with the model's, turn by turn; "
        "resumable by row id",
    )
    regen.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="per regenerated turn (default: what the server's context leaves, as OpenAI)",
    )
    regen.add_argument("--temperature", type=float, default=None, help="0: greedy (default)")
    regen.add_argument("--model-name", default=None, help="the model a server is asked for")
    regen.add_argument(
        "--no-prefix-order",
        action="store_true",
        help="send rows in input order, not rows sharing a first turn together",
    )
    EngineArgs.add_cli_args(parser)  # used when no --url is given: an in-process engine


def read_input(path: Path) -> list[dict[str, Any]]:
    lines, seen = [], set()
    for where, line in read_json_lines(path):
        if not isinstance(line, dict):
            raise TierserveError(f"{where}: not a JSON object", "input")
        missing = [k for k in ("custom_id", "url", "body") if k not in line]
        if missing:
            raise TierserveError(f"{where}: missing {missing}", "input")
        if not isinstance(line["custom_id"], str) or not isinstance(line["body"], dict):
            message = f"{where}: custom_id must be a string and body an object"
            raise TierserveError(message, "input")
        if line["custom_id"] in seen:
            raise TierserveError(f"{where}: duplicate custom_id {line['custom_id']!r}", "input")
        seen.add(line["custom_id"])
        lines.append(line)
    return lines


def line_error(line: dict[str, Any]) -> dict[str, Any] | None:
    """Why a line is not sent, as the server's 400 body would say it (OpenAI's batch output
    writes it as that line's error); None: it may be sent. A url of another type or an absolute
    URL ended the whole run with a traceback, and another host or route was asked."""
    method, url = line.get("method", "POST"), line["url"]
    if method != "POST":
        message = f"method must be POST, as in OpenAI's batch API, got {json.dumps(method)}"
        return _error_body(message, "method")
    if url not in BATCH_ENDPOINTS:
        message = (
            f"url must be one of {', '.join(BATCH_ENDPOINTS)} (a path on the server --url "
            f"names), got {json.dumps(url)}"
        )
        return _error_body(message, "url")
    return None


def _error_body(message: str, param: str) -> dict[str, Any]:
    # protocol.error_body's shape, without importing the server's models for a client.
    return {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": 400}}  # fmt: skip


@dataclass
class Totals(JobUsage):
    completed: int = 0
    failed: int = 0

    def add_reply(self, status: int, body: dict[str, Any]) -> None:
        if status != 200:
            self.failed += 1
            return
        self.completed += 1
        self.add(body.get("usage") or {})


class BatchRunner:
    def __init__(
        self, client: httpx.AsyncClient, out: Path, ns: argparse.Namespace, any_model: bool
    ) -> None:
        self.client, self.out, self.ns = client, out, ns
        self.any_model = any_model  # in-process: the file's model names mean our one model
        self.totals = Totals()
        self.lock = asyncio.Lock()
        self.start = time.perf_counter()
        self.bar: tqdm | None = None  # the progress bar, while `run` runs

    async def run(self, pending: list[dict[str, Any]]) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=len(pending), unit="req", disable=self.ns.no_progress)
        gate = asyncio.Semaphore(self.ns.concurrency)
        with self.out.open("a") as sink:

            async def one(line: dict[str, Any]) -> None:
                status, body = 400, line_error(line)
                if body is None:
                    async with gate:
                        status, body = await self._send(line)
                await self._write(sink, line, status, body)

            await asyncio.gather(*(one(line) for line in pending))
        self.bar.close()

    async def _send(self, line: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        body = {**line["body"], "stream": False}
        if self.any_model:
            body.pop("model", None)
        for attempt in range(self.ns.max_retries + 1):
            try:
                reply = await self.client.post(line["url"], json=body, timeout=None)
                if reply.status_code not in RETRYABLE or attempt == self.ns.max_retries:
                    return reply.status_code, reply.json()
            except (httpx.TransportError, json.JSONDecodeError) as err:
                if attempt == self.ns.max_retries:
                    return 599, {"error": {"message": f"{type(err).__name__}: {err}"}}
            await asyncio.sleep(min(30.0, 0.5 * 2**attempt))
        raise AssertionError("unreachable")

    async def _write(self, sink: Any, line: dict, status: int, body: dict[str, Any]) -> None:
        record = {
            "id": f"batch_req_{uuid.uuid4().hex[:24]}",
            "custom_id": line["custom_id"],
            "response": {"status_code": status, "request_id": body.get("id"), "body": body},
            "error": None if status == 200 else body.get("error"),
        }
        assert self.bar is not None  # called from `run` only
        async with self.lock:
            sink.write(json.dumps(record) + "\n")
            sink.flush()  # survives the process being killed
            self.totals.add_reply(status, body)
            elapsed = time.perf_counter() - self.start
            self.bar.set_postfix(
                tok_s=f"{self.totals.completion_tokens / elapsed:.0f}",
                hit=f"{self.totals.hit_rate:.0%}",
                failed=self.totals.failed,
            )
            self.bar.update(1)

    def summary(self, skipped: int, kept_failed: int) -> str:
        t, elapsed = self.totals, time.perf_counter() - self.start
        kept = f", {kept_failed} failed earlier and kept (--no-retry-failed)" if kept_failed else ""
        return (
            f"batch: {t.completed} completed, {t.failed} failed, {skipped} already done{kept}; "
            f"{t.prompt_tokens} prompt tokens ({t.hit_rate:.1%} cached), "
            f"{t.completion_tokens} completion tokens, "
            f"{t.completion_tokens / max(elapsed, 1e-9):.1f} tok/s over {elapsed:.1f} s"
        )


def run(ns: argparse.Namespace) -> int:
    if ns.concurrency <= 0:
        raise TierserveError("--concurrency must be > 0", "concurrency")
    if ns.max_retries < 0:
        raise TierserveError("--max-retries must be >= 0", "max_retries")
    if ns.url is not None:
        check_url(ns.url)
    if ns.regenerate:  # checked before the lock: a refused run takes no lock
        _check_regenerate_args(ns)
    else:
        _refuse_regenerate_flags(ns)
    check_output(Path(ns.output))
    with output_lock(Path(ns.output)):
        return _regenerate(ns) if ns.regenerate else _batch(ns)


def _batch(ns: argparse.Namespace) -> int:
    lines = read_input(Path(ns.input))
    out = writable_output(Path(ns.output))
    done = read_output(out)
    retry = not ns.no_retry_failed
    if retry and not all(done.values()):
        drop_failed(out)
    pending = [
        line
        for line in lines
        if line["custom_id"] not in done or (retry and not done[line["custom_id"]])
    ]
    kept_failed = sum(1 for line in lines if done.get(line["custom_id"]) is False) * (not retry)
    runner = asyncio.run(_run(pending, out, ns))
    skipped = len(lines) - len(pending) - kept_failed
    print(runner.summary(skipped, kept_failed), file=sys.stderr)
    return 0 if runner.totals.failed == 0 and kept_failed == 0 else 1


# The flags only --regenerate reads (a plain batch's requests carry their own settings), and
# what each is when not given.
REGENERATE_FLAGS = {"max_tokens": None, "temperature": None, "model_name": None,
                    "no_prefix_order": False}  # fmt: skip


def _refuse_regenerate_flags(ns: argparse.Namespace) -> None:
    """A plain batch ran as if they were not given: a sampled answer for --temperature 0."""
    for name, unset in REGENERATE_FLAGS.items():
        if getattr(ns, name) != unset:
            flag = "--" + name.replace("_", "-")
            message = f"{flag} is --regenerate's: a batch line's body sets its own request"
            raise TierserveError(message, name)


def _check_regenerate_args(ns: argparse.Namespace) -> None:
    if ns.max_tokens is not None and ns.max_tokens <= 0:
        raise TierserveError("--max-tokens must be > 0", "max_tokens")
    if ns.temperature is None:
        ns.temperature = 0.0  # greedy
    if not 0 <= ns.temperature < 1e6:  # NaN and inf too: the run died encoding its first row
        message = f"--temperature must be in [0, 1e6), got {ns.temperature}"
        raise TierserveError(message, "temperature")


def _regenerate(ns: argparse.Namespace) -> int:
    from tierserve.batch.regenerate import Regenerator, prefix_order, read_done, read_rows

    rows = read_rows(Path(ns.input))
    out = writable_output(Path(ns.output))
    done = read_done(out)
    pending = [row for row in rows if row.key not in done]
    pending = pending if ns.no_prefix_order else prefix_order(pending)

    async def go() -> Regenerator:
        async with _client(ns) as (client, _):
            regenerator = Regenerator(client, out, ns)
            await regenerator.run(pending)
            return regenerator

    regenerator = asyncio.run(go())
    print(regenerator.summary(len(rows) - len(pending)), file=sys.stderr)
    return 0 if regenerator.progress.failed == 0 else 1


async def _run(pending: list[dict[str, Any]], out: Path, ns: argparse.Namespace) -> BatchRunner:
    async with _client(ns) as (client, in_process):
        runner = BatchRunner(client, out, ns, any_model=in_process)
        await runner.run(pending)
        return runner


@contextlib.asynccontextmanager
async def _client(ns: argparse.Namespace) -> AsyncIterator[tuple[httpx.AsyncClient, bool]]:
    """A client of the server at --url, or of an engine started in this process (True)."""
    if ns.url:
        async with httpx.AsyncClient(base_url=ns.url) as client:
            yield client, False
        return
    from tierserve.server import AsyncEngine, create_app, served_model_name

    args = EngineArgs.from_cli(ns)
    engine = AsyncEngine.launch(args, log_level="warning")
    app = create_app(engine, served_model_name(args))
    engine.start()  # ASGITransport runs no lifespan: start and stop the engine here
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://in-process") as client:
            yield client, True
    finally:
        engine.stop()
