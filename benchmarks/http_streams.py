"""The server's hot path: HTTP streaming against `LLM.generate`, and stop lists against latency.

Side by side in one run, with the demo model and the client on the same machine:

1. Throughput. 64 prompts of 64–512 random token ids, 128 greedy tokens each (EOS ignored).
   `LLM.generate` on them in-process, then the same requests as 64 concurrent streaming
   `POST /v1/completions` to `tierserve serve` (one token per SSE chunk, parsed by an httpx
   client in this process). Reports output tokens/s of both and the ratio (target ≥ 0.85).
2. Isolation. A short request's latency (16-token prompt, 32 tokens) alone, then while one
   request with the longest allowed stop list (64 strings of 512 characters) generates.
   Reports the medians and the ratio (target ≤ 1.5); the same beside a request without stop
   strings shows what sharing the batch alone costs.
3. A control: `LLM.generate` again while another process keeps one core busy `--busy-duty`
   of the time (no HTTP at all). On a 2-core machine this shows what any CPU taken from the
   engine's two torch threads costs, which is what the server's event loop and the client do.

    .venv/bin/python benchmarks/http_streams.py [--model DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from offline_throughput import make_prompts, run_tierserve  # the same prompts and offline run

from tierserve.args import default_model
from tierserve.bench.server_process import ServerProcess, scratch_dir
from tierserve.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

# A process that keeps one core busy for `duty` of the time: what the server's event loop and
# this client take from the engine, without any HTTP.
BUSY = """
import sys, time
duty = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.001:
        pass
    time.sleep(0.001 * (1 - duty) / duty)
"""


def offline_beside_busy_tok_s(
    model: str, prompts: list[list[int]], out_len: int, duty: float
) -> float:
    busy = subprocess.Popen([sys.executable, "-c", BUSY, str(duty)])
    try:
        return run_tierserve(model, prompts, out_len)
    finally:
        busy.kill()
        busy.wait()


async def stream_one(
    url: str, prompt: list[int], max_tokens: int, **extra: Any
) -> tuple[int, int, float]:
    """(events with a choice, completion tokens, seconds) of one streamed completion.

    A plain HTTP/1.1 client on asyncio streams, not httpx: it shares two cores with the server,
    and per event it only splits lines; JSON is parsed for the final usage event alone."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    status = await reader.readline()
    assert b" 200 " in status, status
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers: uvicorn streams with Transfer-Encoding: chunked
    chunks, usage, buffer = 0, None, b""
    while size := int((await reader.readline()).strip() or b"0", 16):
        buffer += await reader.readexactly(size + 2)
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            if b'"usage": {' in event or b'"usage":{' in event:  # json's or msgspec's spacing
                usage = json.loads(event.strip()[6:])["usage"]
            elif event.strip() and event.strip() != b"data: [DONE]":
                chunks += 1
    writer.close()
    assert usage is not None, "no usage event"
    return chunks, usage["completion_tokens"], time.perf_counter() - start


async def http_tok_s(url: str, prompts: list[list[int]], out_len: int) -> tuple[float, int]:
    await stream_one(url, prompts[0][:8], 4)  # warm-up
    httpx.post(f"{url}/flush_cache").raise_for_status()
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_one(url, p, out_len) for p in prompts))
    elapsed = time.perf_counter() - start
    assert all(tokens == out_len for _, tokens, _ in results), results
    chunks = sum(c for c, _, _ in results)
    return len(prompts) * out_len / elapsed, chunks


def longest_stop_list() -> list[str]:
    """MAX_STOP_STRINGS strings of MAX_STOP_CHARS characters, none of which will match."""
    return [f"{i:04d}".ljust(MAX_STOP_CHARS, "~") for i in range(MAX_STOP_STRINGS)]


async def short_latencies(
    url: str, vocab: int, repeats: int, beside: dict[str, Any] | None
) -> list[float]:
    """Latencies of a short request, alone or while a long one (with `beside`'s fields)
    generates."""
    short = list(range(3, 19))
    background = None
    if beside is not None:
        long_prompt = [(7 * i) % (vocab - 3) + 3 for i in range(64)]
        background = asyncio.ensure_future(stream_one(url, long_prompt, 900, **beside))
        await asyncio.sleep(0.5)  # let it start generating
    times = []
    for _ in range(repeats):
        times.append((await stream_one(url, short, 32))[2])
    if background is not None:
        background.cancel()
        await asyncio.gather(background, return_exceptions=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--busy-duty", type=float, default=0.15, help="the control's busy fraction of a core"
    )
    parser.add_argument("--out", default="benchmarks/results/http-streams")
    args = parser.parse_args()
    model = args.model or default_model()
    assert model, "no demo model bundled; pass --model"
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.num_prompts, vocab, seed=0)

    offline = run_tierserve(model, prompts, args.output_len)
    contended = offline_beside_busy_tok_s(model, prompts, args.output_len, args.busy_duty)
    log = scratch_dir() / "server.log"
    with ServerProcess(model, [], log) as server:
        served, chunks = asyncio.run(http_tok_s(server.url, prompts, args.output_len))
        alone = asyncio.run(short_latencies(server.url, vocab, args.repeats, None))
        plain = asyncio.run(short_latencies(server.url, vocab, args.repeats, {}))
        stops = {"stop": longest_stop_list()}
        beside = asyncio.run(short_latencies(server.url, vocab, args.repeats, stops))
    result = {
        "model": model,
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "output_len": args.output_len,
        "offline_tok_s": round(offline, 1),
        "offline_beside_busy_tok_s": round(contended, 1),
        "busy_duty": args.busy_duty,
        "http_tok_s": round(served, 1),
        "http_chunks": chunks,
        "throughput_ratio": round(served / offline, 3),
        "short_alone_s": round(statistics.median(alone), 4),
        "short_beside_plain_s": round(statistics.median(plain), 4),
        "short_beside_stops_s": round(statistics.median(beside), 4),
        "latency_ratio": round(statistics.median(beside) / statistics.median(alone), 3),
    }
    print(f"LLM.generate          {offline:8.1f} output tok/s")
    print(
        f"LLM.generate, busy    {contended:8.1f} output tok/s "
        f"({contended / offline:.2f}x; another process busy {args.busy_duty:.0%} of a core)"
    )
    print(f"{len(prompts)} HTTP streams       {served:8.1f} output tok/s ({chunks} chunks)")
    print(f"ratio                 {served / offline:8.2f}x   (target >= 0.85)")
    print(f"short request alone   {result['short_alone_s'] * 1000:8.1f} ms (median)")
    print(f"beside a plain request{result['short_beside_plain_s'] * 1000:8.1f} ms (median)")
    print(f"beside longest stops  {result['short_beside_stops_s'] * 1000:8.1f} ms (median)")
    print(f"ratio                 {result['latency_ratio']:8.2f}x   (target <= 1.5)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
