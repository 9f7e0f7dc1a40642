"""`tierserve batch --regenerate`: a dataset's assistant turns, answered again by the served
model, turn by turn: the first step of making EAGLE-3 training data (SpecForge's
`regenerate_train_data.py`, speculators' `regenerate-responses`).

Each input row is a conversation: ShareGPT `conversations` ({"from", "value"}) or OpenAI
`messages` ({"role", "content"}), with an optional `id`. Every assistant turn is replaced by the
model's answer to the conversation so far (its earlier turns already regenerated), so each
turn's prompt extends the last one's and the radix cache serves the history. An output line is
the input row with its turns replaced, in the input's own format, plus `status` ("success", or
"error" and an `error`).

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

from tierserve.errors import TierserveError
from tierserve.server.job_usage import JobUsage
from tierserve.server.jsonl import read_json_lines

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass
class Row:
    id: Any  # as the input gave it (any JSON value), else the row's index
    index: int  # its place among the input's rows
    raw: dict[str, Any]
    sharegpt: bool  # `conversations` with from/value, else OpenAI `messages`

    @property
    def key(self) -> str:
        """What identifies the row on resume: its id as JSON, so 1, "1" and null differ."""
        return id_key(self.id)

    @property
    def turns(self) -> list[dict[str, Any]]:
        return self.raw["conversations" if self.sharegpt else "messages"]

    def message(self, turn: dict[str, Any]) -> dict[str, str]:
        if not self.sharegpt:
            return {"role": turn["role"], "content": turn["content"]}
        role = SHAREGPT_ROLES.get(turn["from"], turn["from"])
        return {"role": role, "content": turn["value"]}

    def is_assistant(self, turn: dict[str, Any]) -> bool:
        return self.message(turn)["role"] == "assistant"

    def with_answer(self, turn: dict[str, Any], text: str) -> dict[str, Any]:
        return {**turn, "value" if self.sharegpt else "content": text}


def id_key(row_id: Any) -> str:
    return json.dumps(row_id, sort_keys=True)


def read_rows(path: Path) -> list[Row]:
    """The input's rows; a row without an `id` takes its index (an int) as its id."""
    rows: list[Row] = []
    seen: dict[str, str] = {}  # id key -> where it first came
    for where, line in read_json_lines(path):
        sharegpt = isinstance(line, dict) and isinstance(line.get("conversations"), list)
        if not sharegpt and not (isinstance(line, dict) and isinstance(line.get("messages"), list)):
            raise TierserveError(f"{where}: needs `conversations` or `messages` (a list)", "input")
        row = Row(line["id"] if "id" in line else len(rows), len(rows), line, sharegpt)
        _check_turns(row, where)
        if row.key in seen:
            implicit = "" if "id" in line else " (a row without an id takes its index)"
            message = f"{where}: id {row.key} repeats the one at {seen[row.key]}{implicit}"
            raise TierserveError(message, "input")
        seen[row.key] = where
        rows.append(row)
    return rows


def _check_turns(row: Row, where: str) -> None:
    keys = ("from", "value") if row.sharegpt else ("role", "content")
    for turn in row.turns:
        if not isinstance(turn, dict) or not all(isinstance(turn.get(k), str) for k in keys):
            raise TierserveError(f"{where}: every turn needs string {keys[0]} and {keys[1]}")


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


def prefix_order(rows: list[Row]) -> list[Row]:
    """Rows that open with the same turn, one after another (in their first row's place)."""
    first_seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        key = json.dumps(row.message(row.turns[0])) if row.turns else ""
        first_seen.setdefault(key, i)
    return sorted(
        rows,
        key=lambda r: first_seen[json.dumps(r.message(r.turns[0])) if r.turns else ""],
    )


@dataclass
class Progress(JobUsage):
    rows: int = 0
    failed: int = 0
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
        messages: list[dict[str, str]] = []
        turns = []
        for turn in row.turns:
            if not row.is_assistant(turn):
                messages.append(row.message(turn))
                turns.append(turn)
                continue
            try:
                text = await self._answer(messages)
            except TierserveError as err:
                return {**row.raw, "id": row.id, "status": "error", "error": err.message}
            messages.append({"role": "assistant", "content": text})
            turns.append(row.with_answer(turn, text))
        key = "conversations" if row.sharegpt else "messages"
        record = {**row.raw, "id": row.id, key: turns, "status": "success"}
        if self.ns.hidden_states_dir:
            try:
                record["hidden_states_path"] = await self._capture(row, messages)
            except TierserveError as err:
                return {**row.raw, "id": row.id, "status": "error", "error": err.message}
        return record

    async def _answer(self, messages: list[dict[str, str]]) -> str:
        body = {"messages": messages, "max_tokens": self.ns.max_tokens}
        data = await self._chat({**body, "temperature": self.ns.temperature})
        return data["choices"][0]["message"]["content"] or ""

    async def _capture(self, row: Row, messages: list[dict[str, str]]) -> str:
        """The conversation's hidden states, as `DIR/hs_{index}.safetensors`."""
        body = {"messages": messages, "max_tokens": 1, "add_generation_prompt": False}
        data = await self._chat({**body, "temperature": 0, "return_hidden_states": True}, False)
        source = (data.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not source:
            raise TierserveError(
                "the server wrote no hidden states: start it with --hidden-states-dir"
            )
        target = Path(self.ns.hidden_states_dir) / f"hs_{row.index}.safetensors"
        await asyncio.to_thread(_take, Path(source), target)
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
            self.bar.set_postfix(self.progress.postfix())
            self.bar.update(1)

    def summary(self, skipped: int) -> str:
        p = self.progress
        done = p.rows - p.failed
        stats = ", ".join(f"{k} {v}" for k, v in p.postfix().items() if k != "failed")
        return f"regenerate: {done} rows, {p.failed} failed, {skipped} already done; {stats}"


def _take(source: Path, target: Path) -> None:
    """Wait for the server's file to be whole (its lock free), then move it to `target`."""
    lock = source.with_name(source.name + ".lock")
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
    lock.unlink(missing_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(source), str(target))


def _message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:200]
