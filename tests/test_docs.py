"""The docs keep up with the code: every size flag and every `--hicache-*` flag the parsers take
is written in the doc that owns it, and every relative link in README.md points at a file.

A *size flag* is an option that sets how much of something there is: one of its `--` spellings
has a dash-separated word in SIZE_WORDS (`--max-total-tokens`, `--hicache-size`,
`--mem-fraction-static`, `--avg-seq-len`, ...), or its metavar says it takes a SIZE (plan's
`--host-mem SIZE`, `--gpu PRESET_OR_SIZE`). The rule also catches counts spelled with `size`
(`--tp-size`, `--dp-size`) and the speculative window sizes; those are owned by their docs.

Where each is looked for:
- a `--hicache-*` spelling, of any command: docs/kv-cache.md;
- an engine flag (`EngineArgs`, shared by `serve`, `batch` and `LLM(**kw)`): docs/kv-cache.md,
  unless ENGINE_OWNERS names another doc;
- a command's own flag (`plan`'s, `bench`'s, ...): that command's doc, COMMAND_DOCS.

Every spelling of an option is looked for, as a whole flag (`--tp` does not count as found
inside `--tp-size`). Imports only the torch-free argument parsers; reads files; no network.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from tierserve.args import EngineArgs
from tierserve.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parent.parent
KV_DOC = "docs/kv-cache.md"
# Words of a flag's spelling that make it a size flag (see the docstring).
SIZE_WORDS = frozenset({"size", "tokens", "ratio", "fraction", "memory", "mem", "space"})
SIZE_WORDS |= {"bytes", "gb", "length", "len"}
# Engine size flags described outside docs/kv-cache.md.
ENGINE_OWNERS = {
    "--tp-size": "docs/distributed.md",
    "--tp": "docs/distributed.md",
    "--dp-size": "docs/distributed.md",
    "--dp": "docs/distributed.md",
    "--data-parallel-size": "docs/distributed.md",
    "--speculative-num-draft-tokens": "docs/speculative.md",
    "--speculative-ngram-min-match-window-size": "docs/speculative.md",
    "--speculative-ngram-max-match-window-size": "docs/speculative.md",
}
COMMAND_DOCS = {
    "serve": "docs/server.md",
    "plan": "docs/plan.md",
    "batch": "docs/batch.md",
    "bench": "docs/bench.md",
}


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's options, its subcommands' (bench run, bench compare) included."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _actions(sub)
        elif action.option_strings:
            found.append(action)
    return found


def _spellings(action: argparse.Action) -> tuple[str, ...]:
    return tuple(o for o in action.option_strings if o.startswith("--"))


def _is_size_flag(action: argparse.Action) -> bool:
    words = {w for s in _spellings(action) for w in s[2:].split("-")}
    return bool(words & SIZE_WORDS) or "SIZE" in str(action.metavar or "")


def _parser(add_arguments) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser


def _engine_actions() -> list[argparse.Action]:
    return _actions(_parser(EngineArgs.add_cli_args))


def _wanted() -> dict[str, set[str]]:
    """doc -> the flag spellings it must contain."""
    wanted: dict[str, set[str]] = {}

    def want(flag: str, doc: str) -> None:
        wanted.setdefault(KV_DOC if flag.startswith("--hicache-") else doc, set()).add(flag)

    engine = _engine_actions()
    for action in engine:
        if _is_size_flag(action) or any(s.startswith("--hicache-") for s in _spellings(action)):
            for flag in _spellings(action):
                want(flag, ENGINE_OWNERS.get(flag, KV_DOC))
    engine_options = {_spellings(a) for a in engine}
    for command, doc in COMMAND_DOCS.items():
        module = importlib.import_module(SUBCOMMANDS[command][0])
        for action in _actions(_parser(module.add_arguments)):
            if _spellings(action) in engine_options:
                continue  # an engine flag, checked above
            if _is_size_flag(action) or any(s.startswith("--hicache-") for s in _spellings(action)):
                for flag in _spellings(action):
                    want(flag, doc)
    return wanted


def _mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_size_and_hicache_flag_is_in_the_doc_that_owns_it():
    wanted = _wanted()
    # The rule finds what it is for; and the owners named above are still size flags.
    kv = wanted[KV_DOC]
    assert {"--max-total-tokens", "--mem-fraction-static", "--page-size"} <= kv
    assert {"--hicache-size", "--hicache-node-size", "--hicache-ratio"} <= kv
    assert {"--hicache-write-policy", "--hicache-storage-backend"} <= kv
    engine_flags = {f for a in _engine_actions() if _is_size_flag(a) for f in _spellings(a)}
    assert set(ENGINE_OWNERS) <= engine_flags, set(ENGINE_OWNERS) - engine_flags
    missing = {}
    for doc, flags in sorted(wanted.items()):
        text = (ROOT / doc).read_text(encoding="utf-8")
        absent = sorted(f for f in flags if not _mentions(text, f))
        if absent:
            missing[doc] = absent
    assert not missing, f"flags the docs do not describe: {missing}"


LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.parametrize("page", ["README.md"])
def test_every_relative_link_points_at_a_file(page):
    path = ROOT / page
    links = LINK.findall(path.read_text(encoding="utf-8"))
    relative = [
        link
        for link in links
        if not re.match(r"[a-z][a-z0-9+.-]*:", link, re.IGNORECASE) and not link.startswith("#")
    ]
    assert relative, f"{page}: no relative links found; is the pattern right?"
    broken = [link for link in relative if not (path.parent / link.split("#")[0]).exists()]
    assert not broken, f"{page}: links to files that do not exist: {broken}"
