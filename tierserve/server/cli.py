"""`tierserve serve`: engine flags (shared with `LLM(**kwargs)`) plus where to listen.

The engine is built, and every flag checked, before the port is opened: a bad flag or a cache
that does not fit exits with status 2 and nothing half-started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
from pathlib import Path
from types import FrameType

from tierserve.args import EngineArgs
from tierserve.errors import TierserveError
from tierserve.frontend import DEFAULT_COMPILE_TIMEOUT_S
from tierserve.parsers import REASONING_PARSERS, TOOL_PARSERS
from tierserve.server.watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
from tierserve.utils import bind_server_socket, check_port, listen_address


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: directory name)"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TIERSERVE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /health_generate "
        "and /metrics, as SGLang (default: $TIERSERVE_API_KEY)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a chat request bring its own chat_template (vLLM's flag; a template is a "
        "program whose work nothing bounds: only for clients you trust)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="read tool calls in this family's format (SGLang's names; vLLM's hermes is "
        "qwen25): qwen25 for Qwen2.5 and Qwen3, kimi_k2 for Kimi-K2 and K2.5, deepseekv3 for "
        "DeepSeek-V3 and R1, deepseekv31 for DeepSeek-V3.1 and later. Needed for "
        'tool_choice "auto" (docs/tools.md)',
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='vLLM\'s switch for tool_choice "auto": accepted; here --tool-call-parser alone '
        "enables it, as in SGLang",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="return the reply's <think> block as reasoning_content (and vLLM's reasoning), "
        "apart from its content: qwen3, deepseek-r1, kimi_k2",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check every flag, print the start-up plan (KV pools, host tier, RAM checks) and "
        "exit: 0 it would start, 2 it would be refused; allocates nothing",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request body; slower ones get a 408 "
        "(default: 30; uvicorn has no header timeout: see docs/server.md)",
    )
    parser.add_argument(
        "--watchdog-timeout",
        type=float,
        default=DEFAULT_WATCHDOG_TIMEOUT_S,
        help="seconds one engine step may take; past that (a hung rank, a stuck collective) "
        "/health and every request answer 503 and the server exits 1 "
        f"(default: {DEFAULT_WATCHDOG_TIMEOUT_S:g}, SGLang's)",
    )
    parser.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_COMPILE_TIMEOUT_S,
        help="seconds a structured output's grammar may compile; past that its compile "
        f"process is ended and the request answered 400 (default: {DEFAULT_COMPILE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="a stream sends its first token, then a chunk each time this many tokens have "
        "joined, and the last (vLLM's and SGLang's flag; default: 1, every token). Larger "
        "values cost the API process and the clients fewer chunks",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="answer 503 to new requests while this many wait for admission (default: no bound)",
    )


# How long a failed server still answers /health with 503 before it closes its port.
FAILURE_GRACE_S = 2.0


def _later(delay_s: float, server: object) -> None:
    timer = threading.Timer(delay_s, setattr, (server, "should_exit", True))
    timer.daemon = True
    timer.start()


def _forced_cancel(server: object, record: logging.LogRecord) -> bool:
    """A record of a task that a forced shutdown cancelled: an open request's (with its
    exception), or the lifespan's (Starlette sends its traceback as the message)."""
    if not getattr(server, "force_exit", False):
        return False
    exc = record.exc_info[1] if record.exc_info else None
    said = str(record.msg).rstrip()
    return isinstance(exc, asyncio.CancelledError) or said.endswith("CancelledError")


def served_model_name(args: EngineArgs, override: str | None = None) -> str:
    return override or Path(args.model_dir or "model").name


def dry_run(args: EngineArgs, host: str, port: int) -> int:
    """Every check a start makes before it allocates, and what would be allocated. The
    address is resolved, not bound; the directories a start would make are not made; the
    checkpoint's tensors are checked by their headers against rank 0's model, unread."""
    from tierserve.distributed import describe_wait, resolve_placement, wait_env
    from tierserve.engine import Startup, check_capture_args, startup_table
    from tierserve.frontend import load_tokenizer
    from tierserve.models import check_checkpoint
    from tierserve.storage import backend_class

    listen_address(host, port)
    _, placement = resolve_placement(args, serving=True)
    startup = Startup.from_args(args)
    if startup.storage is not None:
        backend_class(startup.storage.backend).preflight(startup.storage.extra)
    check_capture_args(args, startup.config.num_layers)
    check_checkpoint(startup.model_path, startup.config, args.tp_size, args.attention_tp_size)
    load_tokenizer(args.tokenizer_dir)
    print(f"tierserve serve --dry-run: {startup.model_path} would start", flush=True)
    waits = describe_wait({**os.environ, **wait_env(os.environ)})  # what the core would get
    print(startup_table(startup.plan, args.dp_groups, placement.describe(), waits), flush=True)
    return 0


def run(ns: argparse.Namespace) -> int:
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    args = EngineArgs.from_cli(ns)
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        message = "--enable-auto-tool-choice needs --tool-call-parser (the format to read)"
        raise TierserveError(message, field="tool_call_parser")
    for name in ("max_queued_requests", "stream_interval"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise TierserveError(f"{name} must be >= 1, got {value}", field=name)
    for name in ("body_timeout", "watchdog_timeout", "grammar_compile_timeout"):
        if not 0 < getattr(ns, name) < 1e6:
            message = f"{name} must be in (0, 1e6) seconds, got {getattr(ns, name)}"
            raise TierserveError(message, field=name)
    if ns.served_model_name is not None and not ns.served_model_name.strip():
        message = "--served-model-name is empty: give the name, or leave the flag out"
        raise TierserveError(message, field="served_model_name")
    if ns.api_key is not None and not ns.api_key.strip():  # `--api-key "$KEY"`, KEY unset
        message = "--api-key is empty: give the key, or leave the flag out to serve without one"
        raise TierserveError(message, field="api_key")
    check_port(ns.port)
    if ns.dry_run:
        return dry_run(args, ns.host, ns.port)
    if args.tp_size > 1:
        from tierserve.distributed import global_rank

        if global_rank(args) != 0:
            return follow(args)
    # The address first: a port in use is refused in a second (exit 2), and nothing takes it
    # while the engine loads. It listens only once uvicorn runs.
    sock = bind_server_socket(ns.host, ns.port)
    try:
        return _serve(ns, args, sock)
    finally:
        sock.close()


def _serve(ns: argparse.Namespace, args: EngineArgs, sock: socket.socket) -> int:
    from tierserve.server.core_client import CoreClient, CoreStartError

    # The engine core starts, and every flag is checked, before anything listens: a refusal
    # raises TierserveError (exit 2) here, a core that dies on the way exits 1. It starts
    # first, so that its imports, weights and pools take their time beside this process's.
    core = CoreClient.spawn(args, ns.log_level)
    try:
        import uvicorn

        from tierserve.server.api import create_app
        from tierserve.server.async_engine import AsyncEngine
        from tierserve.server.context import ServerLimits
        from tierserve.server.tools import ChatParsers
    except BaseException:
        core.kill()
        raise
    try:
        async_engine = AsyncEngine.launch(
            args,
            ns.log_level,
            core,
            watchdog_timeout_s=ns.watchdog_timeout,
            grammar_compile_timeout_s=ns.grammar_compile_timeout,
            stream_interval=ns.stream_interval,
        )
    except CoreStartError as err:
        logging.getLogger("tierserve").error("tierserve serve: %s", err)
        return 1
    name = served_model_name(args, ns.served_model_name)
    limits = ServerLimits(
        ns.api_key,
        ns.max_queued_requests,
        ns.body_timeout,
        ns.trust_request_chat_template,
    )
    parsers = ChatParsers(ns.tool_call_parser, ns.reasoning_parser)
    app = create_app(async_engine, name, limits, parsers)
    logger = logging.getLogger("tierserve")
    logger.info(
        "serving %s on http://%s:%d/v1 (engine core: pid %d)",
        name, ns.host, ns.port, async_engine.pid,
    )  # fmt: skip
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        timeout_graceful_shutdown=120,  # SIGTERM: finish in-flight requests, then exit
    )

    class Server(uvicorn.Server):
        """On SIGTERM or SIGINT, also end the grammar compiles in flight at once: their
        requests get a 503 instead of holding the shutdown for a compile's time."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            forced = self.should_exit  # a second signal: uvicorn cancels what is open
            super().handle_exit(sig, frame)
            async_engine.grammar_pool.close()
            if forced:
                logger.warning("forced shutdown (a second signal): open requests are cut")

    server = Server(config)
    # The cancellations of a forced shutdown are its intent, not errors: one line above, no
    # traceback per open request and for the lifespan.
    logging.getLogger("uvicorn.error").addFilter(lambda r: not _forced_cancel(server, r))
    # A dead or hung engine core cannot be revived in place: answer 503 for a moment (a
    # router's health probe sees it), then shut down and exit non-zero, so a supervisor
    # restarts the server.
    async_engine.on_failure = lambda: _later(FAILURE_GRACE_S, server)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has drained: a clean stop
        pass
    finally:
        async_engine.stop()  # done by the lifespan, unless uvicorn failed to start (a port in use)
    if async_engine.error is not None:
        logger.error("exiting with status 1: %s", async_engine.error)
        return 1
    return 0


def follow(args: EngineArgs) -> int:
    """Another node's first rank: its engine follows global rank 0, which serves HTTP."""
    from tierserve.engine import Engine

    engine = Engine(args)
    engine.follow()
    return 0
