"""`tierserve batch --regenerate`: a dataset's assistant turns, answered again by the served
model, turn by turn: the first step of making EAGLE-3 training data (SpecForge's
`regenerate_train_data.py`, speculators' `regenerate-responses`).

Each input row is a conversation: ShareGPT `conversations` ({"from", "value"}) or OpenAI
`messages` ({"role", "content"}), with an optional `id` and optional `tools` (dataset_rows.py
reads both formats' tool turns). Every assistant turn is replaced by the model's answer to the
conversation so far (its earlier turns already regenerated), so each turn's prompt extends the
last one's and the radix cache serves the history. With tools, a turn that called tools is
called again (`tool_choice: required`) and a text turn answered in text (`none`); the tool
results stay as they are, so a row counts the turns whose calls changed
(`divergent_tool_calls`): its later results no longer answer them. An output line is the input
row with its turns replaced, in the input's own format, plus `status` ("success", or "error"
and an `error`) and, on success, `truncated_turns`: the turns cut at `--max-tokens` or the
context (finish_reason "length"), whose rows a training set may want to leave out.

With `--hidden-states-dir DIR` each row's regenerated conversation, as the chat template renders
it, is sent once more (one token) asking for its hidden states, and the server's file becomes
`DIR/hs_{index}.safetensors` (speculators' name; the index is the row's place in the input)
before the row's line is written. The turns themselves never ask for a file.

Resume is by row id, never by count: a line is appended only once its whole row is done, a
torn last line is cut off, and a rerun skips every id that succeeded, so after a kill at any
point each row ends up in the output exactly once. Rows that share their first turn (a system
prompt, a few-shot header) are sent one after another, so that prefix stays cached.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tierserve.batch.dataset_rows import Row, Transcript, id_key, prefix_order, read_rows
from tierserve.batch.job_usage import JobUsage
from tierserve.errors import TierserveError

__all__ = ["Regenerator", "prefix_order", "read_done", "read_rows"]


def read_done(path: Path) -> set[str]:
    """Id keys (Row.key) of the rows already regenerated; a torn last line (a killed run) is
    cut off and rows that failed are dropped, so that a rerun does them again."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    lines = data[:keep].splitlines(keepends=True)
    good = []
    for number, raw in enumerate(lines, 1):
        try:
            record = json.loads(raw)
            status, row_id = record["status"], id_key(record["id"])
        except (ValueError, KeyError, TypeError):
            message = f"{path}:{number}: not a regenerated row; fix or remove it, then rerun"
            raise TierserveError(message, "output") from None
        if status == "success":
            good.append((row_id, raw))
    if len(good) != len(lines) or keep < len(data):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(raw for _, raw in good))
        tmp.replace(path)
    return {row_id for row_id, _ in good}


@dataclass
class Progress(JobUsage):
    rows: int = 0
    failed: int = 0
    truncated_rows: int = 0  # rows with a turn cut at --max-tokens or the context
    start: float = field(default_factory=time.perf_counter)

    def postfix(self) -> dict[str, str]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {
            "rows_s": f"{self.rows / elapsed:.2f}",
            "tok_s": f"{self.completion_tokens / elapsed:.0f}",
            "hit": f"{self.hit_rate:.0%}",
            "failed": str(self.failed),
        }


class Regenerator:
    def __init__(self, client: httpx.AsyncClient, out: Path, ns: argparse.Namespace) -> None:
        self.client, self.out, self.ns = client, out, ns
        self.progress = Progress()
        self.lock = asyncio.Lock()
        self.bar: Any = None

    async def run(self, rows: list[Row]) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=len(rows), unit="row", disable=self.ns.no_progress)
        gate = asyncio.Semaphore(self.ns.concurrency)
        with self.out.open("a") as sink:

            async def one(row: Row) -> None:
                async with gate:
                    record = await self._regenerate(row)
                await self._write(sink, record)

            await asyncio.gather(*(one(row) for row in rows))
        self.bar.close()

    async def _regenerate(self, row: Row) -> dict[str, Any]:
        transcript, turns, divergent, truncated = Transcript(row), [], 0, 0
        for turn in row.turns:
            if not row.is_assistant(turn):
                transcript.add(turn)
                turns.append(turn)
                continue
            original = row.calls_in(turn)
            try:
                choice = await self._answer(transcript.messages, row, turn, original)
            except TierserveError as err:
                return {**row.raw, "id": row.id, "status": "error", "error": err.message}
            message = choice["message"]
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in message.get("tool_calls") or []]  # fmt: skip
            divergent += calls != original
            truncated += choice.get("finish_reason") == "length"
            transcript.add_reply(message)
            turns.append(row.written(turn, message))
        key = "conversations" if row.sharegpt else "messages"
        # A turn cut at --max-tokens or the context is the model's, but not a whole answer:
        # counted, so a training set can leave its row out.
        record = {**row.raw, "id": row.id, key: turns, "status": "success"}
        record["truncated_turns"] = truncated
        if row.tools is not None:  # later tool results answer the original calls, not these
            record["divergent_tool_calls"] = divergent
        if self.ns.hidden_states_dir:
            try:
                record["hidden_states_path"] = await self._capture(row, transcript.messages)
            except TierserveError as err:
                return {**row.raw, "id": row.id, "status": "error", "error": err.message}
        return record

    async def _answer(
        self, messages: list[dict[str, Any]], row: Row, turn: dict[str, Any], original: list
    ) -> dict[str, Any]:
        """The turn answered again: the reply's choice (message and finish_reason). With the
        row's tools, a turn that called tools is asked to call them again (`required`, as many
        calls may run at once as it made) and a text turn for text (`none`): the row's later
        turns keep answering a turn of the same kind."""
        body: dict[str, Any] = {"messages": messages}
        if self.ns.max_tokens is not None:
            body["max_tokens"] = self.ns.max_tokens
        if row.tools is not None:
            body["tools"] = row.tools
            body["tool_choice"] = "required" if original else "none"
            body["parallel_tool_calls"] = len(original) > 1
        data = await self._chat({**body, "temperature": self.ns.temperature})
        choice = data["choices"][0]
        for k, call in enumerate(choice["message"].get("tool_calls") or []):
            ids = [c.get("id") for c in turn.get("tool_calls") or []]
            if k < len(ids) and ids[k]:  # the row's tool results name these ids
                call["id"] = ids[k]
        return choice

    async def _capture(self, row: Row, messages: list[dict[str, Any]]) -> str:
        """The conversation's hidden states, as `DIR/hs_{index}.safetensors`: rendered with
        the row's tools, as its turns were."""
        body: dict[str, Any] = {"messages": messages, "max_tokens": 1}
        body["add_generation_prompt"] = False
        if row.tools is not None:
            body |= {"tools": row.tools, "tool_choice": "none"}
        data = await self._chat({**body, "temperature": 0, "return_hidden_states": True}, False)
        source = (data.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not source:
            raise TierserveError(
                "the server wrote no hidden states: start it with --hidden-states-dir"
            )
        directory = Path(self.ns.hidden_states_dir).expanduser()
        target = directory / f"hs_{row.index}.safetensors"
        await asyncio.to_thread(_take, _server_file(str(source), directory), target)
        return str(target)

    async def _chat(self, body: dict[str, Any], counted: bool = True) -> dict[str, Any]:
        if self.ns.model_name:
            body["model"] = self.ns.model_name
        body.setdefault("return_hidden_states", False)
        for attempt in range(self.ns.max_retries + 1):
            try:
                reply = await self.client.post("/v1/chat/completions", json=body, timeout=None)
                if reply.status_code == 200:
                    data = reply.json()
                    if counted:  # a capture's prompt is recomputed: not the job's hit rate
                        self.progress.add(data.get("usage") or {})
                    return data
                if reply.status_code < 500 and reply.status_code != 429:
                    raise TierserveError(f"{reply.status_code}: {_message(reply)}")
            except httpx.TransportError as err:
                if attempt == self.ns.max_retries:
                    raise TierserveError(f"{type(err).__name__}: {err}") from None
            await asyncio.sleep(min(30.0, 0.5 * 2**attempt))
        raise TierserveError(f"gave up after {self.ns.max_retries + 1} tries")

    async def _write(self, sink: Any, record: dict[str, Any]) -> None:
        async with self.lock:
            sink.write(json.dumps(record) + "\n")
            sink.flush()  # a whole row, or nothing: what a killed run leaves
            self.progress.rows += 1
            self.progress.failed += record["status"] != "success"
            self.progress.truncated_rows += record.get("truncated_turns", 0) > 0
            self.bar.set_postfix(self.progress.postfix())
            self.bar.update(1)

    def summary(self, skipped: int) -> str:
        p = self.progress
        done = p.rows - p.failed
        stats = ", ".join(f"{k} {v}" for k, v in p.postfix().items() if k != "failed")
        cut = f" ({p.truncated_rows} with a turn cut short)" if p.truncated_rows else ""
        return f"regenerate: {done} rows{cut}, {p.failed} failed, {skipped} already done; {stats}"


# What --regenerate --hidden-states-dir needs, said when a server's file is not there.
SAME_DIR = (
    "--hidden-states-dir must be the server's own --hidden-states-dir, on a filesystem this "
    "client shares with the server (it moves the server's files there)"
)


def _server_file(source: str, directory: Path) -> Path:
    """Where the server's file is, which must lie in `directory`: the client moves it, so a
    reply never makes it move a file elsewhere. A relative path is the server's, from its own
    working directory: the file is looked up by its name in `directory`."""
    path = Path(source)
    path = path if path.is_absolute() else directory / path.name
    try:
        inside = path.resolve().is_relative_to(directory.resolve())
    except (OSError, ValueError):  # a symlink loop, a NUL in the name
        inside = False
    if not inside:
        message = f"the server wrote its hidden states to {source}, outside {directory}: {SAME_DIR}"
        raise TierserveError(message)
    return path


def _take(source: Path, target: Path) -> None:
    """Wait for the server's file to be whole (its lock free), then move it to `target`."""
    lock = source.with_name(source.name + ".lock")
    try:
        with open(lock) as held:
            fcntl.flock(held, fcntl.LOCK_EX)
        lock.unlink(missing_ok=True)
    except FileNotFoundError:  # the server removes the locks of whole files no reader took
        pass
    except OSError as err:
        message = f"cannot wait for the server's hidden states {source}: {err.strerror}"
        raise TierserveError(message) from None
    if not source.is_file():  # a server on another machine, or its directory another one
        message = f"the server's hidden states {source.name} are not in {source.parent}"
        raise TierserveError(f"{message}: {SAME_DIR}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(source), str(target))
    except OSError as err:  # the file gone, or the directory not writable: this row's error
        message = f"cannot move the server's hidden states {source} to {target}: {err.strerror}"
        raise TierserveError(message) from None


def _message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:200]
