"""vLLM's `speculators` commands, unmodified, in their own virtualenv (built by `make`), against
a real tierserve server: `prepare-data` (through /v1/chat/completions/render), then
`generate-offline-data --validate-outputs` (token-id completions, kv_transfer_params, the lock
files), whose files load through speculators' own training dataset; and `regenerate-responses`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

import tierserve
from tests.conftest import Server

ROOT = Path(__file__).resolve().parents[1]
SPEC_VENV = ROOT / ".venv-speculators"
DEMO_DIR = Path(tierserve.__file__).parent / "demo_model"
ROWS = 4
LOAD = """
import json, sys
from pathlib import Path
import torch
from speculators.train.data import ArrowDataset, FileTransfer
prep, files = sys.argv[1], sys.argv[2]
ds = ArrowDataset(max_len=512, datapath=prep, transfer=FileTransfer(Path(files)),
                  on_missing="raise", hidden_states_dtype=torch.float32)
print(json.dumps([{k: list(v.shape) for k, v in ds[i].items()} for i in range(len(ds.data))]))
"""


def speculators(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    tool = SPEC_VENV / "bin" / "speculators"
    if not tool.exists():
        pytest.fail(f"{tool} is missing: `make` builds it (make test does)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_COLOR": "1"}
    done = subprocess.run(
        [str(tool), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def dataset(path: Path) -> Path:
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"write a short line about item {i}"},
                {"from": "gpt", "value": f"item {i} is a fine thing to have"},
            ]
        }
        for i in range(ROWS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_speculators_makes_eagle3_data_from_a_tierserve_server(tmp_path):
    data = dataset(tmp_path / "data.jsonl")
    flags = ("--device", "cpu", "--hidden-states-dir", str(tmp_path / "hs"))
    # As with vLLM, the served name is the path speculators also loads the tokenizer from.
    with Server(DEMO_DIR, *flags, "--served-model-name", str(DEMO_DIR)) as server:
        prep, offline = tmp_path / "prep", tmp_path / "offline"
        speculators(
            "prepare-data", "--model", str(DEMO_DIR), "--data", str(data), "--output",
            str(prep), "--render-endpoint", server.url, "--seq-length", "512", cwd=tmp_path,
        )  # fmt: skip
        speculators(
            "generate-offline-data", "--endpoint", f"{server.url}/v1", "--preprocessed-data",
            str(prep), "--output", str(offline), "--validate-outputs", cwd=tmp_path,
        )  # fmt: skip
        files = sorted(offline.glob("hs_*.safetensors"))
        assert len(files) == ROWS
        for path in files:
            tensors = load_file(str(path))
            seq = tensors["token_ids"].shape[0]
            assert tensors["hidden_states"].shape == (seq, 4, 256)  # 3 aux layers + the last
        loaded = subprocess.run(
            [str(SPEC_VENV / "bin" / "python"), "-c", LOAD, str(prep), str(offline)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert loaded.returncode == 0, loaded.stderr[-3000:]
        for item in json.loads(loaded.stdout.strip().splitlines()[-1]):
            seq = item["input_ids"][0]
            assert item["hidden_states"] == [seq, 3 * 256]  # the trainer's aux layers
            assert item["verifier_last_hidden_states"] == [seq, 256]

        out = tmp_path / "regen.jsonl"
        speculators(
            "regenerate-responses", "--endpoint", f"{server.url}/v1/chat/completions",
            "--model", str(DEMO_DIR), "--dataset", str(data), "--max-tokens", "8",
            "--outfile", str(out), cwd=tmp_path,
        )  # fmt: skip
        regenerated = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(regenerated) == ROWS and all("error" not in r["metadata"] for r in regenerated)
