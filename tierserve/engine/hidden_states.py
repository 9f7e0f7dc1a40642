"""Hidden states for EAGLE-3 training data: a server started with `--hidden-states-dir DIR`
writes, for every request, its prompt's hidden states at the auxiliary layers and at the final
norm's input into one safetensors file, in the form vLLM's extract_hidden_states writes and
vLLM's `speculators` reads: `token_ids` [seq] and `hidden_states` [seq, layers + 1, hidden] in
the model's dtype.

Layer ids are vLLM's: id k is the output of decoder layer k − 1 (transformers'
`hidden_states[k]`; 0 is the embeddings); the default is EAGLE-3's (2, L // 2, L − 3). The last
slot is the final norm's input.

Files are written by one thread behind a bounded queue, so the engine never waits on the disk
unless that many files are already waiting (then it does: memory stays bounded). `PATH.lock`
exists, held with an exclusive flock, from before the request's first token is reported until
the file is whole. As with vLLM's connector, the reader takes the lock once it is free and
removes the lock file itself (speculators does).

Capture never endangers the server: a file that cannot be opened, locked or written (a full,
vanished or replaced directory) is that request's file lost, logged and counted, and the request
is answered without a path. Locks that no reader takes are bounded: once a file is whole its
lock only tells a reader so, and the writer removes locks left more than LOCK_TTL_S seconds, or
beyond the newest UNREAD_LOCKS (a whole file needs no lock: it is renamed into place whole).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import logging
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tierserve.errors import TierserveError
from tierserve.utils import unusable_dir

if TYPE_CHECKING:
    from tierserve.args import EngineArgs
    from tierserve.engine.request import Request
    from tierserve.model_config import ModelConfig

logger = logging.getLogger("tierserve")

QUEUED_FILES = 8  # files waiting for the writer before the engine waits for it
LOCK_TTL_S = 600.0  # a whole file's lock left by no reader is removed after this long
UNREAD_LOCKS = 1024  # and beyond this many such locks, the oldest go first
MAX_NAME = 200  # characters of a request id kept in its file's name (filesystems allow 255)


def default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's auxiliary layers (vLLM's default): early, middle, late."""
    return (2, num_layers // 2, num_layers - 3)


def parse_layers(text: str | None, num_layers: int) -> tuple[int, ...]:
    """`--hidden-states-layers` ("2,14,25"), checked against the model's layers."""
    if text is None:
        return tuple(max(0, k) for k in default_layers(num_layers))
    try:
        layers = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        message = f"--hidden-states-layers takes layer ids like 2,14,25, got {text!r}"
        raise TierserveError(message, "hidden_states_layers") from None
    bad = [k for k in layers if not 0 <= k <= num_layers]
    if not layers or bad:
        message = (
            f"--hidden-states-layers must be ids in [0, {num_layers}] (k: the output of decoder "
            f"layer k − 1), got {text!r}"
        )
        raise TierserveError(message, "hidden_states_layers")
    return layers


def check_capture_args(args: EngineArgs, num_layers: int) -> tuple[int, ...]:
    """`--hidden-states-layers` read, and `--hidden-states-dir` one this process could make
    and write (nothing is made): what a start checks, asked by the dry run too."""
    layers = parse_layers(args.hidden_states_layers, num_layers)
    directory = args.hidden_states_dir
    if directory is not None and (why := unusable_dir(Path(directory).expanduser())):
        message = f"--hidden-states-dir {directory} cannot be used: {why}"
        raise TierserveError(message, "hidden_states_dir")
    return layers


class HiddenStatesWriter:
    def __init__(self, directory: str) -> None:
        # Absolute: replies name this path to clients whose working directory is not ours.
        self.directory = Path(directory).expanduser().absolute()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / ".tierserve-write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            message = f"--hidden-states-dir {directory} is not writable: {err.strerror or err}"
            raise TierserveError(message, "hidden_states_dir") from None
        self.failed = 0
        self.written = 0
        self.locks_expired = 0
        # Locks of whole files, oldest first, that a reader may still take (and remove).
        self._unread: collections.deque[tuple[float, Path]] = collections.deque()
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUED_FILES)
        self._thread = threading.Thread(target=self._run, name="tierserve-hidden-states")
        self._thread.daemon = True
        self._thread.start()

    def path_for(self, request_id: str) -> Path:
        """The id as the file's name; an id that is no file name as it stands (other
        characters, too long, a hidden file's) gets its hash too, so that "x/y" and "x_y"
        never share a file."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", request_id)
        if safe != request_id or len(safe) > MAX_NAME or safe.startswith("."):
            digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()
            safe = f"{safe[:MAX_NAME].replace('.', '_', 1)}-{digest[:16]}"
        return self.directory / f"{safe}.safetensors"

    def submit(self, request_id: str, token_ids: list[int], hidden: torch.Tensor) -> str | None:
        """Queue the file of one request; its lock is held from now until it is written. None:
        the lock could not be taken (the directory is gone, full or not a directory), so this
        file is lost and the request goes on without one."""
        path = self.path_for(request_id)
        lock_path, lock = path.with_name(path.name + ".lock"), None
        try:
            lock = open(lock_path, "w")  # noqa: SIM115 (held until written)
            # Never waits: a reader still holding the lock of this id's earlier file would
            # hold the engine's step, and every request, for as long as it likes.
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            held = isinstance(err, BlockingIOError)
            if held:
                err = OSError(err.errno, "the lock of this id's earlier file is held (a reader)")
            if lock is not None:
                lock.close()
                if not held:  # a held lock is its reader's to remove
                    lock_path.unlink(missing_ok=True)
            self._lost(path, err)
            return None
        ids = torch.tensor(token_ids, dtype=torch.long)
        self._queue.put((path, lock, ids, hidden))
        return str(path)

    def close(self, timeout_s: float = 30.0) -> None:
        """Let queued files finish (bounded), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _lost(self, path: Path, err: Exception) -> None:
        why = err.strerror if isinstance(err, OSError) and err.strerror else err
        logger.error("hidden states of %s not captured: %s", path.name, why)
        self.failed += 1

    def _run(self) -> None:
        from safetensors.torch import save_file

        while (item := self._queue.get()) is not None:
            path, lock, ids, hidden = item
            tmp = path.with_name(path.name + ".tmp")
            lock_path = Path(lock.name)
            try:
                tensors = {"token_ids": ids, "hidden_states": hidden.contiguous()}
                save_file(tensors, str(tmp))
                os.replace(tmp, path)
                self.written += 1
                self._unread.append((time.monotonic(), lock_path))
            except Exception as err:  # a full or vanished disk: this file is lost, not the server
                self._lost(path, err)
                for leftover in (tmp, path, lock_path):
                    with contextlib.suppress(OSError):
                        leftover.unlink(missing_ok=True)
            finally:
                lock.close()  # releases the flock: the reader may go on
            self._expire_locks()

    def _expire_locks(self) -> None:
        """Remove the locks of whole files that no reader took in time (or too many of them)."""
        deadline = time.monotonic() - LOCK_TTL_S
        while self._unread and (self._unread[0][0] < deadline or len(self._unread) > UNREAD_LOCKS):
            _, lock_path = self._unread.popleft()
            with contextlib.suppress(OSError):
                lock_path.unlink()  # FileNotFoundError: a reader took it, as it should
                self.locks_expired += 1


class HiddenStateCapture:
    """What the engine captures of prompts: the layer ids the runner keeps, and each request's
    rows until its prompt is whole, then queued as one file. Every rank counts the rows (its
    scheduler's cache matches depend on them); only a rank with a writer keeps them."""

    def __init__(self, layers: tuple[int, ...], hidden_size: int, dtype: torch.dtype) -> None:
        self.layers = layers
        # On disk per prompt token: its id and its layers' states (with the final norm's input).
        self.bytes_per_token = 8 + (len(layers) + 1) * hidden_size * dtype.itemsize if layers else 0
        self.writer: HiddenStatesWriter | None = None

    @classmethod
    def of(
        cls, args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, writes: bool
    ) -> HiddenStateCapture:
        """What `--hidden-states-dir` and `--hidden-states-layers` ask for; `writes`: this rank
        writes the files (the first of its attention group, whose ranks hold the same states)."""
        layers = check_capture_args(args, cfg.num_layers)  # checked even unused
        if args.hidden_states_dir is None:
            return cls((), cfg.hidden_size, dtype)
        capture = cls(layers, cfg.hidden_size, dtype)
        if writes:
            capture.writer = HiddenStatesWriter(args.hidden_states_dir)
        return capture

    def keep(self, req: Request, rows: torch.Tensor) -> None:
        """Rows of `req`'s prompt as the runner captured them; the last ones queue its file."""
        req.num_captured += len(rows)
        if self.writer is None:
            return
        req.hidden.append(rows)
        if req.num_captured == len(req.prompt_ids):
            hidden, req.hidden = torch.cat(req.hidden), []
            req.hidden_states_path = self.writer.submit(req.rid, req.prompt_ids, hidden)

    def close(self, timeout_s: float) -> None:
        if self.writer is not None:
            self.writer.close(timeout_s)
