"""The API process's work on requests, outside the engine core: tokenizing and checking what
arrives (`RequestPreparer`), compiling grammars (in worker processes: `GrammarCompilePool`),
and turning the core's token ids into the text and outputs a user sees (`OutputBuilder`). The
offline `LLM` does the same work in its own process. Nothing here imports torch at import time.
"""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.frontend.grammar import (
        CACHE_BYTES,
        MAX_GRAMMAR_CHARS,
        MAX_SCHEMA_ENUM_VALUES,
        Grammars,
        GrammarState,
        check_size,
        compile_spec,
        new_compiler,
        tokenizer_info,
    )
    from tierserve.frontend.grammar_pool import (
        CompilerFailed,
        GrammarCompilePool,
        ShuttingDown,
    )
    from tierserve.frontend.grammar_worker import (
        COMPILE_HOLD_ENV,
        DEFAULT_COMPILE_TIMEOUT_S,
        WorkerSetup,
    )
    from tierserve.frontend.output import (
        MAX_UNSETTLED,
        IncrementalDetokenizer,
        OutputBuilder,
    )
    from tierserve.frontend.prepare import (
        MAX_CHARS_PER_TOKEN,
        RequestPreparer,
    )
    from tierserve.frontend.structured_fields import (
        ResponseFormat,
        StructuredOutputs,
    )
    from tierserve.frontend.tokenizer import (
        eos_token_id,
        lazy_tokenizer,
        load_tokenizer,
    )

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
EXPORTS = {
    "CACHE_BYTES": "grammar",
    "COMPILE_HOLD_ENV": "grammar_worker",
    "CompilerFailed": "grammar_pool",
    "DEFAULT_COMPILE_TIMEOUT_S": "grammar_worker",
    "GrammarCompilePool": "grammar_pool",
    "GrammarState": "grammar",
    "Grammars": "grammar",
    "IncrementalDetokenizer": "output",
    "MAX_CHARS_PER_TOKEN": "prepare",
    "MAX_GRAMMAR_CHARS": "grammar",
    "MAX_SCHEMA_ENUM_VALUES": "grammar",
    "MAX_UNSETTLED": "output",
    "OutputBuilder": "output",
    "RequestPreparer": "prepare",
    "ResponseFormat": "structured_fields",
    "ShuttingDown": "grammar_pool",
    "StructuredOutputs": "structured_fields",
    "WorkerSetup": "grammar_worker",
    "check_size": "grammar",
    "compile_spec": "grammar",
    "eos_token_id": "tokenizer",
    "lazy_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "new_compiler": "grammar",
    "tokenizer_info": "grammar",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
