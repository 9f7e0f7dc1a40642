"""`tierserve batch --regenerate` against a real server: every assistant turn answered again
turn by turn, in the input's own format; killed with SIGKILL once the output holds 1, 3 and 5
rows and rerun, each row is written exactly once and equals a run without crashes (greedy)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from safetensors.torch import load_file

import tierserve
import tierserve.batch.output_file as batch_module
from tests.conftest import eventually
from tierserve import TierserveError
from tierserve.batch.regenerate import prefix_order, read_done, read_rows
from tierserve.batch.runner import output_lock

DEMO_DIR = Path(tierserve.__file__).parent / "demo_model"
SYSTEMS = ["You answer briefly.", "You are a careful assistant who explains."]
WORDS = ("the", "a", "code", "list", "sort", "function", "value", "error", "test", "file")


# Bounded arguments: the demo model has no tool format, and its forced calls must end.
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ASKED = {"city": "Paris", "unit": "c"}


def tool_rows() -> list[dict]:
    """An agentic row in each format: a call, its result, then a text answer."""
    openai_row = {
        "id": "tools-openai",
        "tools": [{"type": "function", "function": WEATHER}],
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_a",
             "type": "function", "function": {"name": "get_weather",
             "arguments": json.dumps(ASKED)}}]},
            {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
            {"role": "assistant", "content": "old"},
        ],
    }  # fmt: skip
    sharegpt_row = {  # LLaMA-Factory's form: tools as JSON text, calls as function_call turns
        "id": "tools-sharegpt",
        "tools": json.dumps([WEATHER]),
        "conversations": [
            {"from": "human", "value": "weather in Oslo?"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                           "arguments": ASKED})},
            {"from": "observation", "value": "3 C"},
            {"from": "gpt", "value": "old answer"},
        ],
    }  # fmt: skip
    return [openai_row, sharegpt_row]


def dataset(path: Path, rows: int = 8, tools: bool = False) -> Path:
    """ShareGPT rows (two system prompts, two user turns each) and two OpenAI-format rows;
    with `tools`, an agentic row in each format too."""
    lines = tool_rows() if tools else []
    for i in range(rows):
        ask = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(k, k + 5)) for k in (0, 3)]
        turns = [{"from": "system", "value": SYSTEMS[i % 2]}]
        for q in ask:
            turns += [{"from": "human", "value": q}, {"from": "gpt", "value": "old answer"}]
        lines.append({"id": f"row-{i}", "conversations": turns})
    for i in range(2):
        messages = [{"role": "user", "content": f"say {WORDS[i]}"}]
        lines.append({"messages": [*messages, {"role": "assistant", "content": "old"}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def regenerate(url: str, src: Path, out: Path, *more: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tierserve.cli", "batch", str(src), "-o", str(out), "--url", url]
    cmd += ["--regenerate", "--max-tokens", "12", "--no-progress", *more]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def rows_in(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(raw) for raw in path.read_text().splitlines() if raw.strip()]


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


def test_regenerated_rows_replace_every_assistant_turn(server, tmp_path):
    src = dataset(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    proc = regenerate(server.url, src, out, "--concurrency", "4")
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
    rows = {r["id"]: r for r in rows_in(out)}
    # Rows without an id take their index, written back as the number it is.
    assert sorted(rows, key=str) == sorted([f"row-{i}" for i in range(8)] + [8, 9], key=str)
    cut = 0
    for row in rows.values():
        assert row["status"] == "success"
        cut += row["truncated_turns"] > 0
        turns = row.get("conversations") or row["messages"]
        answers = [
            t.get("value", t.get("content"))
            for t in turns
            if t.get("from", t.get("role")) in ("gpt", "assistant")
        ]
        assert answers and all(a not in ("old answer", "old") for a in answers)
        assert 0 <= row["truncated_turns"] <= len(answers)
    said = proc.stderr.read().decode()
    assert (f"rows ({cut} with a turn cut short)" in said) == (cut > 0), said
    # The second turn's prompt is the first turn's conversation: the radix cache served it.
    assert server.metrics()["tierserve_cached_tokens_total{tier=device}"] > 0


def test_agentic_rows_are_regenerated_in_their_own_format(server, tmp_path):
    """Tool-call turns called again (forced: tool_choice required) in the row's format, the
    tool results kept, the call ids the results name kept, divergent calls counted."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in tool_rows()))
    out = tmp_path / "out.jsonl"
    proc = regenerate(server.url, src, out, "--max-tokens", "120")
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
    rows = {r["id"]: r for r in rows_in(out)}
    messages = rows["tools-openai"]["messages"]
    (call,) = messages[1]["tool_calls"]
    assert call["id"] == "call_a" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["parameters"])
    assert messages[2] == tool_rows()[0]["messages"][2]  # the tool's result, as it was
    assert messages[3]["content"] not in ("old", None) and "tool_calls" not in messages[3]
    turns = rows["tools-sharegpt"]["conversations"]
    assert turns[1]["from"] == "function_call"
    value = json.loads(turns[1]["value"])
    assert value["name"] == "get_weather"
    jsonschema.validate(value["arguments"], WEATHER["parameters"])
    assert turns[2] == {"from": "observation", "value": "3 C"}
    assert turns[3]["from"] == "gpt" and turns[3]["value"] != "old answer"
    made = {"tools-openai": call["function"]["arguments"], "tools-sharegpt": value["arguments"]}
    for row_id, arguments in made.items():
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        assert rows[row_id]["divergent_tool_calls"] == (arguments != ASKED)


def test_a_killed_run_resumes_by_row_id_exactly_once(server, tmp_path):
    src = dataset(tmp_path / "in.jsonl", tools=True)
    clean = tmp_path / "clean.jsonl"
    assert regenerate(server.url, src, clean).wait(timeout=300) == 0
    want = {r["id"]: r for r in rows_in(clean)}
    out = tmp_path / "out.jsonl"
    for rows in (1, 3, 5):  # kill -9 once the output holds this many rows, then rerun
        proc = regenerate(server.url, src, out, "--concurrency", "1")

        def written(rows: int = rows, proc: subprocess.Popen = proc) -> bool:
            return len(rows_in(out)) >= rows or proc.poll() is not None

        assert eventually(written, 120)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert regenerate(server.url, src, out).wait(timeout=300) == 0
    got = rows_in(out)
    assert sorted((r["id"] for r in got), key=str) == sorted(want, key=str)  # each row once
    assert {r["id"]: r for r in got} == want  # greedy: the same answers as without crashes


def test_resume_drops_a_torn_line_and_failed_rows(tmp_path):
    out = tmp_path / "out.jsonl"
    ok = {"id": "a", "status": "success", "messages": []}
    failed = {"id": "b", "status": "error", "error": "x"}
    out.write_text(json.dumps(ok) + "\n" + json.dumps(failed) + "\n" + '{"id": "c", "sta')
    assert read_done(out) == {'"a"'}  # ids as JSON: "1" and 1 are two rows
    assert rows_in(out) == [ok]  # b is done again, c's torn line is gone


def test_rows_that_share_a_first_turn_run_together(tmp_path):
    rows = read_rows(dataset(tmp_path / "in.jsonl"))
    order = [r.turns[0].get("value", r.turns[0].get("content")) for r in prefix_order(rows)]
    firsts = list(dict.fromkeys(order))
    assert order == sorted(order, key=firsts.index)  # each first turn's rows are adjacent


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"text": "no turns"}', "needs `conversations` or `messages`"),
        ('{"messages": [{"role": "user"}]}', "string role and content"),
        ("not json", "not JSON"),
        # Python's json read these; the run then died encoding the row, mid-run.
        ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"default": NaN}]}',
         "NaN is no JSON number"),
        ('{"messages": [{"role": "user", "content": "hi"}], "x": -Infinity}',
         "-Infinity is no JSON number"),
        # Regenerated as text, its tool result answering nothing, and counted a success.
        ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null,'
         ' "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",'
         ' "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "x"}]}',
         "calls tools, but the row gives no tools"),
        # Refused by the server after a round trip each, with the rows before them sent.
        ('{"messages": [{"role": "usr", "content": "hi"}]}', "role: Input should be"),
        ('{"messages": [{"role": "tool", "content": "18 C"}]}', "needs the tool_call_id"),
        ('{"conversations": [{"from": "bot", "value": "hi"}]}', "from 'bot' is none of"),
    ],
)  # fmt: skip
def test_bad_rows_are_refused_with_their_line(tmp_path, line, needle):
    src = tmp_path / "in.jsonl"
    src.write_text(line + "\n")
    with pytest.raises(TierserveError, match=needle):
        read_rows(src)


def test_a_line_that_is_not_utf8_is_refused_with_its_line_and_status_2(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"messages": []}\n{"messages": [], "id": "\xff\xfe"}\n')
    cmd = [sys.executable, "-m", "tierserve.cli", "batch", str(src), "-o", str(tmp_path / "o")]
    done = subprocess.run([*cmd, "--regenerate", "--url", "http://127.0.0.1:9"], text=True,
                          capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"{src}:2: not UTF-8" in done.stderr and "Traceback" not in done.stderr


def test_a_second_run_on_one_output_is_refused_while_the_first_holds_it(tmp_path):
    """Two runs on one output lost rows (one rewrote the file the other appended to) or wrote
    them twice; a non-finite temperature ended the run with a traceback at its first row."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "tierserve.cli", "batch", str(src), "-o", str(out),
           "--regenerate", "--url", "http://127.0.0.1:9"]  # fmt: skip
    with output_lock(out):  # the first run, holding the output
        done = subprocess.run(cmd, text=True, capture_output=True, timeout=120)
        assert (tmp_path / "out.jsonl.lock").exists()
    assert done.returncode == 2 and "is being written by another run" in done.stderr
    assert not (tmp_path / "out.jsonl.lock").exists()  # removed by the run that held it
    assert not out.exists() or out.read_text() == ""
    for bad in ("nan", "inf", "-1", "1e6"):
        done = subprocess.run([*cmd, "--temperature", bad], text=True, capture_output=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 2 and "must be in [0, 1e6)" in done.stderr, done.stderr


def test_ids_are_written_back_as_they_came_and_a_clash_names_the_row_that_repeats(tmp_path):
    turns = [{"role": "user", "content": "hi"}]
    ids = [None, {"a": [1]}, 7, "7"]  # each its own row: JSON values, not their str()
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "messages": turns}) + "\n" for i in ids))
    rows = read_rows(src)
    assert [r.id for r in rows] == ids
    record = {**rows[1].raw, "id": rows[1].id, "status": "success"}
    (tmp_path / "out.jsonl").write_text(json.dumps(record) + "\n")
    assert read_done(tmp_path / "out.jsonl") == {rows[1].key}  # resumes that row, no other
    # A row without an id takes its index; the explicit id 1 after it is the one that repeats.
    clash = [{"messages": turns}, {"messages": turns}, {"id": 1, "messages": turns}]
    src.write_text("".join(json.dumps(line) + "\n" for line in clash))
    with pytest.raises(TierserveError, match=rf"{src}:3: id 1 repeats the one at {src}:2"):
        read_rows(src)


def test_regenerated_rows_come_with_their_hidden_states(tmp_path):
    """In-process (no --url): every output row's conversation as the template renders it, in
    speculators' hs_{index} file, equal in length to the rendered conversation."""
    src = dataset(tmp_path / "in.jsonl", rows=2)
    out, hs = tmp_path / "out.jsonl", tmp_path / "hs"
    cmd = [sys.executable, "-m", "tierserve.cli", "batch", str(src), "-o", str(out)]
    cmd += ["--regenerate", "--max-tokens", "6", "--no-progress", "--device", "cpu"]
    cmd += ["--model", str(DEMO_DIR), "--hidden-states-dir", str(hs)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["id"]: r for r in rows_in(out)}
    assert sorted(p.name for p in hs.glob("hs_*.safetensors")) == [
        f"hs_{i}.safetensors" for i in range(4)
    ]
    assert not list(hs.glob("*.lock")) and not list(hs.glob("*cmpl*"))  # moved, none left
    tensors = load_file(rows["row-0"]["hidden_states_path"])
    assert tensors["hidden_states"].shape[:2] == (tensors["token_ids"].shape[0], 4)


def test_hidden_states_are_taken_only_from_the_directory_given(tmp_path, monkeypatch):
    """A server whose reply names its file relative to its own working directory (the file
    is in the directory given, by name), one that wrote it elsewhere, and one whose file is
    not here (a remote server): the first row is regenerated, the others are rows with an
    error that says what is needed, and the file elsewhere stays. Each once ended the run
    with a FileNotFoundError and no row written, or moved whatever path the reply named."""
    import argparse
    import asyncio

    import httpx

    from tierserve.batch.regenerate import Regenerator

    hs, elsewhere = tmp_path / "hs", tmp_path / "elsewhere"
    hs.mkdir()
    elsewhere.mkdir()
    (hs / "rel.safetensors").write_bytes(b"relative")
    (hs / "rel.safetensors.lock").touch()  # free: the server wrote the file whole
    (elsewhere / "far.safetensors").write_bytes(b"far")
    replies = {"rel": "capture/rel.safetensors", "far": str(elsewhere / "far.safetensors"),
               "remote": str(hs / "remote.safetensors")}  # fmt: skip

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        reply = {"choices": [{"message": {"role": "assistant", "content": "new"},
                              "finish_reason": "stop"}], "usage": {}}  # fmt: skip
        if body["return_hidden_states"]:
            path = replies[body["messages"][0]["content"]]
            reply["kv_transfer_params"] = {"hidden_states_path": path}
        return httpx.Response(200, json=reply)

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": name, "messages": [
        {"role": "user", "content": name}, {"role": "assistant", "content": "old"}]}) + "\n"
        for name in replies))  # fmt: skip
    out = tmp_path / "out.jsonl"
    ns = argparse.Namespace(concurrency=1, no_progress=True, max_tokens=None, temperature=0.0,
                            model_name=None, max_retries=0, hidden_states_dir=str(hs))  # fmt: skip
    monkeypatch.chdir(tmp_path)  # the client's own directory holds no capture/

    async def go() -> None:
        transport = httpx.MockTransport(server)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            await Regenerator(client, out, ns).run(read_rows(src))

    asyncio.run(go())
    rows = {r["id"]: r for r in rows_in(out)}
    assert rows["rel"]["status"] == "success", rows["rel"]
    assert (hs / "hs_0.safetensors").read_bytes() == b"relative"
    assert not (hs / "rel.safetensors.lock").exists()
    for name, where in (("far", "outside"), ("remote", "are not in")):
        assert rows[name]["status"] == "error" and where in rows[name]["error"], rows[name]
        assert "must be the server's own --hidden-states-dir" in rows[name]["error"]
    assert (elsewhere / "far.safetensors").read_bytes() == b"far"  # not moved
    assert sorted(p.name for p in hs.iterdir()) == ["hs_0.safetensors"]


def test_without_max_tokens_a_turn_runs_to_the_context_and_is_counted_cut(tmp_path):
    """The default once was 2048 tokens a turn, past the demo model's context: every row
    failed. Unset, a turn may take what the context leaves (OpenAI's default)."""
    src = tmp_path / "in.jsonl"
    turns = [{"role": "user", "content": "say the"}, {"role": "assistant", "content": "old"}]
    src.write_text(json.dumps({"id": "a", "messages": turns}) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "tierserve.cli", "batch", str(src), "-o", str(out)]
    cmd += ["--regenerate", "--no-progress", "--device", "cpu", "--model", str(DEMO_DIR)]
    # The prompt is 8 tokens and the demo model's greedy answer 9 (it ends at 20 tokens of
    # context): 16 cut it, 24 do not.
    for context, cut in (("16", 1), ("24", 0)):
        out.unlink(missing_ok=True)
        done = subprocess.run([*cmd, "--context-length", context], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        (row,) = rows_in(out)
        assert row["status"] == "success" and row["truncated_turns"] == cut
        assert ("1 rows (1 with a turn cut short)" in done.stderr) == bool(cut)


def test_a_run_that_opened_a_lock_file_its_holder_then_removed_opens_it_again(
    tmp_path, monkeypatch
):
    """A run ending removes its OUT.lock while it holds it. A run that had opened the file just
    before would lock a file no one else sees, and a third run would take a lock of its own."""
    out, lock = tmp_path / "out.jsonl", tmp_path / "out.jsonl.lock"
    opened = []
    real_open = os.open

    def open_then_lose_the_race(path, *args):
        fd = real_open(path, *args)
        opened.append(os.fstat(fd).st_ino)
        if len(opened) == 1:
            os.unlink(path)  # what the holder does as it ends, between this open and the flock
        return fd

    monkeypatch.setattr(batch_module.os, "open", open_then_lose_the_race)
    with output_lock(out):
        monkeypatch.undo()
        assert len(opened) == 2 and lock.stat().st_ino == opened[1]  # the file others see
        with pytest.raises(TierserveError, match="being written by another run"), output_lock(out):
            pass
    assert not lock.exists()


@pytest.mark.parametrize(
    "flags",
    [["--temperature", "0"], ["--max-tokens", "3"], ["--model-name", "x"], ["--no-prefix-order"]],
)
def test_a_plain_batch_refuses_the_flags_only_regenerate_reads(tmp_path, flags):
    """A plain batch's lines carry their own request bodies: these flags did nothing there
    (a sampled answer for --temperature 0, an unchecked --model-name)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "tierserve.cli", "batch", str(src), "-o", str(out),
           "--url", "http://127.0.0.1:9", *flags]  # fmt: skip
    done = subprocess.run(cmd, text=True, capture_output=True, timeout=120)
    assert done.returncode == 2 and "is --regenerate's" in done.stderr, done.stderr
    assert flags[0] in done.stderr and not out.exists()
