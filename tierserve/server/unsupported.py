"""The OpenAI routes' fields that tierserve refuses: its own list, since each client library and
peer server adds fields of its own, and one that changes the answer must never be ignored."""

from __future__ import annotations

# Fields of OpenAI's, vLLM's and SGLang's requests that tierserve does not implement, each of
# which changes what comes back: refused when set, never silently ignored. Other unknown fields
# (metadata, store, extras) are ignored, as OpenAI-compatible servers do.
UNSUPPORTED_FIELDS = frozenset(
    {
        "best_of",
        "suffix",
        "functions",  # OpenAI's deprecated form of tools
        "function_call",
        "audio",
        "modalities",
        "prediction",
        # vLLM's sampling extensions
        "use_beam_search",
        "length_penalty",
        "logits_processors",
        "return_tokens_as_token_ids",
        "prompt_embeds",
        "cache_salt",  # a prefix cache kept apart per salt: ignored, it would be shared
        "vllm_xargs",
        "thinking_token_budget",
        # vLLM's guided decoding (tierserve's is response_format, and SGLang's regex and ebnf)
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "structural_tag",
    }
)
