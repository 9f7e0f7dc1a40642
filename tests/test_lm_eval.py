"""lm-evaluation-harness against a real server (`local-completions`, token-id prompts): a
multiple-choice task and a generate_until task, written here with their data (no hub). Every
loglikelihood equals the same harness's `hf` model on the same checkpoint, with the server's
prefix cache cold and then warm."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Server

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

WORDS = ["cat", "dog", "sky", "sea", "tree", "king", "stone", "river"]
# Longer than a KV page, so the contexts leave whole pages in the prefix cache.
PREAMBLE = "answer with the colour that fits best , one word only . " * 3
CHOICES = ["red", "blue", "green", "the sun"]


def write_tasks(root: Path) -> Path:
    rows = [
        {"question": f"{PREAMBLE}the {w} is", "choices": CHOICES, "label": i % len(CHOICES)}
        for i, w in enumerate(WORDS)
    ]
    data = root / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        'test_split: test\ndoc_to_text: "{{question}}"\n'
    )
    (root / "mc.yaml").write_text(
        "task: ts_mc\noutput_type: multiple_choice\n" + common
        + 'doc_to_choice: "{{choices}}"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n'
    )  # fmt: skip
    (root / "gen.yaml").write_text(
        "task: ts_gen\noutput_type: generate_until\n" + common
        + 'doc_to_target: "{{choices[0]}}"\n'
        + 'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        + "metric_list:\n  - metric: exact_match\n"
    )  # fmt: skip
    return root


def loglikelihoods(results: dict[str, Any]) -> list[float]:
    """Each (document, choice)'s summed continuation logprob, in the harness's order."""
    samples = sorted(results["samples"]["ts_mc"], key=lambda s: s["doc_id"])
    return [resp[0][0] for s in samples for resp in s["resps"]]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> TaskManager:
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    # Only the tasks written here: indexing the harness's own 13,986 task files took ~15 s.
    root = write_tasks(tmp_path_factory.mktemp("tasks"))
    return TaskManager(include_path=str(root), include_defaults=False)


def test_harness_loglikelihoods_equal_hf_cold_and_warm(llama_dir, tasks):
    reference = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={llama_dir},dtype=float32,device=cpu",
        tasks=["ts_mc"],
        task_manager=tasks,
        log_samples=True,
    )
    want = loglikelihoods(reference)
    assert len(want) == len(WORDS) * len(CHOICES)
    server = Server(llama_dir, "--max-total-tokens", "4096")
    try:
        args = (
            f"base_url={server.url}/v1/completions,model={llama_dir.name},"
            f"tokenizer_backend=huggingface,tokenizer={llama_dir},tokenized_requests=True,"
            "num_concurrent=2,max_retries=1"
        )
        runs, warm = [], []
        for tasks_run in (["ts_mc", "ts_gen"], ["ts_mc"]):  # the second finds prompts cached
            warm.append(server.metrics()["tierserve_radix_cached_pages{tier=device}"])
            runs.append(
                lm_eval.simple_evaluate(
                    model="local-completions",
                    model_args=args,
                    tasks=tasks_run,
                    task_manager=tasks,
                    log_samples=True,
                )
            )
    finally:
        server.stop()
    assert warm[0] == 0 and warm[1] > 0  # cold, then the contexts' pages are cached
    for run in runs:
        assert loglikelihoods(run) == pytest.approx(want, abs=1e-4)
    generated = runs[0]["samples"]["ts_gen"]
    assert len(generated) == len(WORDS)
    assert all(isinstance(s["resps"][0][0], str) for s in generated)
    assert "exact_match,none" in runs[0]["results"]["ts_gen"]
