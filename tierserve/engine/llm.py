"""Offline API: `LLM(path, **engine_args).generate(prompts, params)`, and `.chat(messages,
params)` for conversations, as vLLM's."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, cast

from pydantic import ValidationError

from tierserve.args import EngineArgs
from tierserve.chat import ChatTemplateFields, first_problem, render
from tierserve.distributed import set_wait_here
from tierserve.engine.engine import Engine
from tierserve.engine.startup import resolve_device
from tierserve.errors import TierserveError
from tierserve.frontend import OutputBuilder
from tierserve.outputs import RequestOutput
from tierserve.sampling_params import SamplingParams

Prompt = str | list[int]
Conversation = Sequence[dict[str, Any]]

__all__ = ["LLM", "RequestOutput"]


# vLLM's CPU default for its offline LLM (its server keeps 2048, as ours does): a prefilling
# step of 4096 tokens a tensor-parallel rank, whose share of each GEMM is then 4096 rows'
# worth. The offline batch of benchmarks/vllm_peer.py ran 1.085× as fast as at 2048 on a
# 2-core EPYC, and 0.94× at 8192 (benchmarks/results/offline-chunk/report.md).
OFFLINE_CPU_CHUNK = 4096


def offline_chunk(args: EngineArgs) -> int:
    """`chunked_prefill_size` for an `LLM` that does not set it (checked `args`): vLLM's
    offline CPU budget on a CPU-only host, else the server's."""
    if resolve_device(args.device).type != "cpu":
        return args.chunked_prefill_size
    return OFFLINE_CPU_CHUNK * args.tp_size


class LLM:
    """Every engine flag is a keyword argument here: `--page-size 16` is `page_size=16`.

    With `tp_size` > 1 one LLM at a time may be open in a process (it holds torch's process
    group): close it (`close()`, `with LLM(...)`), or drop every reference to it, before the
    next. Calls from several threads run one after another (a stream holds the engine until
    it ends or is closed): each steps the whole engine and keeps only its own outputs."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # Offline, the first batch is the work: a warm-up before it only adds its own time.
        engine_args.setdefault("skip_server_warmup", True)
        set_wait_here()  # only warns here if torch came first: `import tierserve` set it then
        self.args = EngineArgs.from_kwargs(model, **engine_args)
        if "chunked_prefill_size" not in engine_args:  # from the checked device and tp_size
            self.args = replace(self.args, chunked_prefill_size=offline_chunk(self.args))
        self.engine = Engine(self.args)
        self._lock = threading.RLock()
        # The requests of every open call (a generate, the streams open in this thread) and
        # the outputs each has not taken yet: whichever call steps the engine keeps them all.
        self._open: dict[str, OutputBuilder] = {}
        self._ready: dict[str, list[RequestOutput]] = {}
        # An LLM nobody holds (`del llm`, `llm = None`) still stops its ranks and leaves the
        # group, and so does one left open at interpreter exit. The finalizer holds the engine
        # only: holding the LLM would keep it alive.
        self._finalizer = weakref.finalize(self, self.engine.close)
        try:  # offline, every output is text: a tokenizer that cannot load is refused now
            _ = self.engine.tokenizer
        except BaseException:
            self.close()
            raise

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel ranks (and the storage tier's writers); idempotent."""
        self._finalizer()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise TierserveError("this LLM is closed: make a new one", "model")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together (continuous batching); outputs in the prompts' order."""
        prompts = _as_list(prompts)
        params_list = _broadcast(params, len(prompts))
        with self._lock:
            self._check_open()
            return self._generate(prompts, params_list)

    def _generate(
        self, prompts: list[Prompt], params_list: list[SamplingParams]
    ) -> list[RequestOutput]:
        rids: list[str] = []
        samples: list[list[str]] = []  # each prompt's requests, its first sample's first
        # A first sample's prompt and the other samples' params: they start once it has its
        # first token, from its prefix in the radix cache (as the server's `n` choices do).
        later: dict[str, tuple[int, Prompt, list[SamplingParams]]] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
                rid = self._submit(prompt, p.sample(0))  # a bad one: those before it abort
                rids.append(rid)
                samples.append([rid])
                if p.n > 1:
                    later[rid] = (i, prompt, [p.sample(j) for j in range(1, p.n)])
            mine, finished = set(rids), dict[str, RequestOutput]()
            touched = rids  # outputs another call's steps kept for these may be waiting
            while True:
                for rid in mine.intersection(touched):
                    outs = self._take(rid)
                    if outs and rid in later:
                        i, prompt, rest = later.pop(rid)
                        samples[i] += [self._submit(prompt, q) for q in rest]
                        rids += samples[i][1:]
                        mine.update(samples[i][1:])
                    finished.update((o.request_id, o) for o in outs if o.finished)
                if len(finished) == len(rids) and not later:
                    return [_merged([finished[r] for r in rs]) for rs in samples]
                touched = self._step()
        finally:  # an error or a Ctrl-C mid-run: nothing of this call keeps running
            for rid in rids:
                self._forget(rid)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a
        list of them, read as the server's chat route reads them (content parts, tool calls,
        the same checks) and rendered by the model's chat template or `chat_template`, then
        run as `generate` runs."""
        switches = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": tools,
            "chat_template": chat_template,
            "chat_template_kwargs": chat_template_kwargs,
        }
        prompts: list[Prompt] = [self._render(c, switches) for c in _conversations(messages)]
        return self.generate(prompts, params)

    def _render(self, conversation: Conversation, switches: dict[str, Any]) -> list[int]:
        """The conversation's prompt ids: its text as the template renders it, tokenized
        without special tokens, which the template has written (a second BOS otherwise)."""
        try:
            fields = ChatTemplateFields.model_validate({"messages": conversation, **switches})
        except ValidationError as err:
            where, said = first_problem(err)
            where = where or "messages"  # the whole conversation's (a lone surrogate)
            raise TierserveError(f"{where}: {said}", where.split(".")[0]) from None
        text = render(self.tokenizer, fields, trust_request_template=True)  # the caller's own
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yields text deltas of one prompt as its tokens are produced. Other calls may run
        while it is open (in this thread: the engine stays held until the stream ends or is
        closed); each keeps its own outputs."""
        prompts = _as_list(prompt)
        if len(prompts) != 1:
            raise TierserveError("generate_stream takes one prompt", "prompt")
        (params,) = _broadcast(params, 1)
        if params.n != 1:
            raise TierserveError("generate_stream streams one sample: use generate for n > 1", "n")
        with self._lock:
            self._check_open()
            rid = self._submit(prompts[0], params)
            try:
                while True:
                    outs = self._take(rid)
                    if not outs:
                        self._step()
                    for out in outs:
                        if out.text_delta:
                            yield out.text_delta
                        if out.finished:
                            return
            finally:
                self._forget(rid)  # a consumer that stops early frees the request's KV

    def _submit(self, prompt: Prompt, params: SamplingParams) -> str:
        req = self.engine.make_request(prompt, params, None, self.engine.next_arrival())
        self.engine.submit(req)
        eos = frozenset(self.engine.eos_token_ids)
        self._open[req.rid] = OutputBuilder(req, self.tokenizer, eos)
        self._ready[req.rid] = []
        return req.rid

    def _step(self) -> list[str]:
        """One engine step, its outputs kept for the calls whose requests they are (their ids
        returned); a request a stop string ended is aborted before the next step, so it
        samples nothing more."""
        if not self.engine.has_unfinished():  # every open request's outputs are already kept
            raise RuntimeError("an open request is missing from the engine")
        touched = []
        for step in self.engine.step():
            builder = self._open.get(step.request_id)
            if builder is None:
                continue
            out = builder.add(step)
            if out is None:
                continue
            if builder.stopped_here:
                self.engine.abort(step.request_id)
            self._ready[step.request_id].append(out)
            touched.append(step.request_id)
        return touched

    def _take(self, rid: str) -> list[RequestOutput]:
        outs, self._ready[rid] = self._ready[rid], []
        return outs

    def _forget(self, rid: str) -> None:
        builder = self._open.pop(rid)
        del self._ready[rid]
        if not builder.finished:
            self.engine.abort(rid)


PROMPTS = "prompts must be a string, a list of token ids, or a list of those"
CONVERSATIONS = (
    "messages must be a conversation (a non-empty list of {'role', 'content'} dicts) "
    "or a list of those"
)


def _merged(outs: list[RequestOutput]) -> RequestOutput:
    """A prompt's samples as one output (vLLM's): the first's, with all of them listed."""
    if len(outs) == 1:
        return outs[0]
    return replace(outs[0], samples=[out.as_sample(j) for j, out in enumerate(outs)])


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list | tuple):  # bytes read as token ids, a dict as its keys
        raise TierserveError(f"{PROMPTS}, got {type(prompts).__name__}", "prompt")
    if prompts and all(isinstance(t, int) for t in prompts):
        return [cast("list[int]", list(prompts))]  # a single token-id prompt
    if not all(isinstance(p, str | list | tuple) for p in prompts):
        raise TierserveError(PROMPTS, "prompt")
    return cast("list[Prompt]", list(prompts))  # each checked just above


def _conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation or a list of them, each a list of message dicts."""
    given: Sequence[Any] = messages  # what a caller passed: checked here
    if isinstance(given, list | tuple) and given and isinstance(given[0], dict):
        given = [given]  # one conversation
    if not isinstance(given, list | tuple) or not given:
        raise TierserveError(CONVERSATIONS, "messages")
    for conversation in given:
        if not isinstance(conversation, list | tuple) or not conversation:
            raise TierserveError(CONVERSATIONS, "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in conversation):
            raise TierserveError(CONVERSATIONS, "messages")
    return list(given)


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, list | tuple) or not all(
        isinstance(p, SamplingParams) for p in params
    ):
        message = "params must be a SamplingParams or a list of them, one per prompt"
        raise TierserveError(message, "params")
    if len(params) != n:
        raise TierserveError(f"{len(params)} SamplingParams for {n} prompts", "params")
    return list(params)
