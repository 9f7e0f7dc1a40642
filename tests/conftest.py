"""Tiny random-init Hugging Face checkpoints, made with `save_pretrained` inside the test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import torch

import tierserve
from tierserve import LLM
from tierserve.bench.client import parse_prometheus
from tierserve.bench.server_process import ServerProcess, local_client
from tierserve.engine import CORE_MODULE, INTAKE_HOLD_ENV, STEP_GATE_ENV

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

# The tests' HTTP calls to their servers: one client, since `httpx.get` builds one per call and
# the tests' polling loops (eventually, metrics) would take a core from the servers they wait on.
http = local_client()

VOCAB = 320
TRAINING_TEXT = (
    "Once upon a time there was a small cache that wanted to keep every key and value. "
    "The server sent requests; the scheduler batched them; pages moved between tiers. "
    "Héllo wörld, naïve café: ünïcode bytes split across tokens. 你好，世界。 "
) * 8


def make_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)


# Tiny DeepSeek-V3 / V2: MLA, dense first layer then MoE; the variants cover q_lora_rank or a
# direct query projection, yarn, grouped (V3) and group-limited (V2) routing, shared experts.
DEEPSEEK_COMMON = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 512,  # × factor = max_position_embeddings
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _deepseek_families() -> dict[str, tuple[type, type, dict]]:
    import transformers

    v3 = (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
    v2 = (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
    return {
        "deepseek-v3": (
            *v3,
            dict(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1,
                 norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN),
        ),
        "deepseek-v3-direct-q": (
            *v3,
            dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                 norm_topk_prob=False, routed_scaling_factor=1.0),
        ),
        "deepseek-v2": (
            *v2,
            dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                 n_shared_experts=2, routed_scaling_factor=1.5),
        ),
    }  # fmt: skip


DEEPSEEK_FAMILIES = _deepseek_families()


def randomise_all(model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    """Every parameter and persistent buffer random: transformers starts the router's
    e_score_correction_bias at zero, which would hide a router that ignores it; norms stay
    near one so activations keep their scale through the layers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            noise = torch.randn(t.shape, generator=g)
            t.copy_(1 + scale * noise if "norm" in name else scale * noise)


def make_checkpoint(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A 2-layer GQA model of the given family with random weights and our test tokenizer."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,  # spread-out logits: greedy ties between engines are unlikely
        bos_token_id=0,
        eos_token_id=1,
    )
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "llama3": (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            },
        ),
        "qwen2": (
            transformers.Qwen2Config,
            transformers.Qwen2ForCausalLM,
            {"tie_word_embeddings": True},
        ),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
        **DEEPSEEK_FAMILIES,
    }
    config_cls, model_cls, extra = configs[family]
    torch.manual_seed(seed)
    if family in DEEPSEEK_FAMILIES:
        common = {**common, **DEEPSEEK_COMMON}
    config = config_cls(**{**common, **extra, **overrides})
    model = model_cls(config).eval()
    if family == "qwen2":  # biases start at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if family in DEEPSEEK_FAMILIES:
        randomise_all(model, seed)
    model.save_pretrained(path)
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    families = ("llama", "llama3", "qwen2", "qwen3", *DEEPSEEK_FAMILIES)
    return {f: make_checkpoint(root / f, f) for f in families}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"]


def once_per_run(root: Path, name: str, compute: Callable[[], Any]) -> Any:
    """`compute()`'s JSON result, computed once per test run: the suite's worker processes
    share it through `root` (the `run_dir` fixture) under a lock; the first to ask computes,
    the others wait and read. `name` must say all the result depends on (weights by hash)."""
    import fcntl
    import json

    path = root / "once" / f"{name}.json"
    path.parent.mkdir(exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        result = compute()
        path.write_text(json.dumps(result))
        return result


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """A directory of this test run that all its worker processes see (pytest-xdist gives
    each worker a base directory inside the run's)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def weights_hash(checkpoint: Path) -> str:
    """What a checkpoint computes, as a short hash: its weights and its config (two families'
    tiny checkpoints can hold the same tensors and differ in rope scaling)."""
    import hashlib

    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((checkpoint / name).read_bytes())
    return digest.hexdigest()[:16]


def random_prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()
        for i in range(n)
    ]


# --- how the suite runs on two workers (`make test`: pytest-xdist, --dist loadgroup) ----------

# Files whose servers run with short timeouts (a 2 s body or watchdog timeout, a 0.1 s store
# call, a router's 1 s health checks): they run one after another on one worker, never beside
# each other. A test marks itself with `@pytest.mark.xdist_group("timeouts")` where the rest of
# its file has none.
TIMEOUT_FILES = {
    "test_server.py", "test_engine_core.py", "test_tp_server.py", "test_storage.py",
    "test_router.py",
}  # fmt: skip
# The longest groups first (test-seconds summed in a `--durations 0` run here: timeouts 247,
# test_tp.py 130, test_dp_attention.py 104, test_eagle3.py 78 ...), so that the short ones
# fill in at the end and neither worker is left alone with a long one.
LONGEST_FIRST = (
    "timeouts", "test_tp.py", "test_dp_attention.py", "test_eagle3.py", "test_speculators.py",
    "test_speculative.py", "test_tp_storage.py", "test_hicache.py", "test_grammar_limits.py",
    "test_openapi.py", "test_mtp.py", "test_regenerate.py", "test_structured_output.py",
    "test_async_copies.py",
)  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    # xdist hands groups out by how many tests each holds unless told not to, which put a
    # one-test file of 50 s (test_speculators.py) at the end; the order below is the order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each file is one group (its module-scoped servers start once), the TIMEOUT_FILES one
    group together; the groups in LONGEST_FIRST order, the same on every worker, as xdist
    needs."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            name = item.path.name
            item.add_marker(pytest.mark.xdist_group("timeouts" if name in TIMEOUT_FILES else name))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def group(item: pytest.Item) -> str:
        return item.get_closest_marker("xdist_group").args[0]

    items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable: files stay whole


# --- a real server, for the tests that speak HTTP -------------------------------------------


def serve_cmd(model: Path, *flags: str) -> list[str]:
    """`tierserve serve --model MODEL FLAGS...` as a subprocess command line."""
    return [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(model), *flags]


def hold_steps(gate: Path, batches: int) -> None:
    """Let an engine under STEP_GATE_ENV = `gate` run until it has run `batches` in all."""
    part = gate.with_suffix(".part")
    part.write_text(str(batches))
    part.replace(gate)  # whole, never half-written, when the engine reads it


class Server(ServerProcess):
    """`tierserve serve` in a subprocess (the benchmark's launcher), plus its parsed /metrics
    and its step gate: tests order its steps with `hold_steps` and `release_steps`, never by
    how fast the machine runs them."""

    # Where servers keep their logs and step gates: this run's pytest directory (set by
    # `_server_dirs`), which pytest prunes to the last three runs; /tmp kept one per server.
    base: Path | None = None

    def __init__(self, model: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        root = Path(tempfile.mkdtemp(prefix="server-", dir=Server.base))
        self.gate = root / "step-gate"
        self.intake = root / "intake-hold"  # present: the core takes no message (core_hooks)
        hooks = {STEP_GATE_ENV: str(self.gate), INTAKE_HOLD_ENV: str(self.intake)}
        env = {**os.environ, **hooks, **(env or {})}
        super().__init__(str(model), flags, root / "server.log", startup_timeout_s=180, env=env)

    @property
    def core(self) -> psutil.Process:
        """The engine core's process (the server's child running engine/core.py)."""
        (core,) = [
            p for p in psutil.Process(self.proc.pid).children() if CORE_MODULE in p.cmdline()
        ]
        return core

    def metrics(self) -> dict[str, float]:
        """/metrics with the core's current values. A scrape the core did not answer within
        the server's bound (1 s) carries its last values, marked stale: on a slow machine a
        test would act on old counts (a step gate set from them), so it is asked again."""
        seen: dict[str, float] = {}

        def fresh() -> bool:
            seen.update(parse_prometheus(self.http.get(f"{self.url}/metrics", timeout=60).text))
            return seen.get("tierserve_engine_metrics_stale") == 0

        assert eventually(fresh, 120), f"the engine core gave no fresh metrics: {seen}"
        return seen

    def hold_steps(self, steps: int = 0) -> None:
        """Let the engine run `steps` more batches, then wait (call it while it is idle or
        already held, so that the count it starts from stands still)."""
        hold_steps(self.gate, int(self.metrics()["tierserve_engine_steps_total"]) + steps)

    def release_steps(self) -> None:
        self.gate.unlink(missing_ok=True)

    def wait_for(self, ready: Callable[[dict[str, float]], bool], timeout_s: float = 60) -> None:
        """Poll /metrics until `ready(metrics)` (bounded: a hang fails the test, never blocks)."""
        reached = eventually(lambda: ready(self.metrics()), timeout_s)
        assert reached, f"not reached in {timeout_s} s: {self.metrics()}"


@pytest.fixture(scope="session", autouse=True)
def _server_dirs(tmp_path_factory) -> None:
    Server.base = tmp_path_factory.mktemp("servers")


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: nobody may reap it here)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def maps_library(proc: psutil.Process, library: str) -> bool:
    """Whether `proc` has a shared library whose file name starts with `library` loaded (what
    a process has imported, seen from outside it)."""
    return any(Path(m.path).name.startswith(library) for m in proc.memory_maps())


def modules_after(code: str, *argv: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code` with `argv`: what a start-up
    path imports, which a test process that imported everything already cannot show."""
    code += "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def eventually(check: Callable[[], bool], within_s: float) -> bool:
    """Whether `check()` holds within `within_s` seconds of polling: for what happens soon but
    not at one instant (a kill landing, a counter moving), never for how fast work runs."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# One server and one offline engine per test process, shared by every file that does not
# bring its own (each start costs a few CPU-seconds); the tests leave them as they found them.
@pytest.fixture(scope="session")
def server(llama_dir) -> Iterator[Server]:
    s = Server(
        llama_dir, "--max-total-tokens", "4096", "--body-timeout", "2",
        "--trust-request-chat-template",
    )  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="session")
def demo_server() -> Iterator[Server]:
    """The bundled demo model (a trained tokenizer and chat template) served with defaults,
    shared as `server` is."""
    with Server(Path(tierserve.__file__).parent / "demo_model", "--device", "cpu") as s:
        yield s


@pytest.fixture(scope="module")  # a file's own `server` may override the shared one
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="session")
def offline(llama_dir) -> LLM:
    return LLM(str(llama_dir), max_total_tokens=4096)


def make_eagle3_draft(
    path: Path, target: Path, seed: int = 0, draft_vocab: int | None = None, sglang: bool = False
) -> Path:
    """A random-init EAGLE-3 draft for `target` in the speculators format (or SGLang's:
    `midlayer.*` weights, a Llama config naming LlamaForCausalLMEagle3), written as those tools
    write one; `draft_vocab` < the target's vocabulary maps draft ids through `d2t`."""
    import json

    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab, inter, layers = cfg["vocab_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    dv = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    prefix = "midlayer." if sglang else "layers.0."
    w = {
        "fc.weight": rand(hidden, 3 * hidden),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(dv, hidden),
        prefix + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        prefix + "self_attn.k_proj.weight": rand(kv * head_dim, 2 * hidden),
        prefix + "self_attn.v_proj.weight": rand(kv * head_dim, 2 * hidden),
        prefix + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": rand(inter, hidden),
        prefix + "mlp.up_proj.weight": rand(inter, hidden),
        prefix + "mlp.down_proj.weight": rand(hidden, inter),
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[prefix + norm + ".weight"] = 1 + rand(hidden)
    if dv < vocab:
        keep = torch.sort(torch.randperm(vocab, generator=g)[:dv]).values
        w["d2t"] = keep - torch.arange(dv)
    layer = {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "rms_norm_eps": 1e-5,
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
    }  # fmt: skip
    aux = [1, max(1, layers // 2), layers]
    if sglang:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": dv,
                  "norm_before_residual": True,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}  # fmt: skip
    else:
        config = {
            "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": dv,
            "norm_before_residual": True, "target_hidden_size": hidden,
            "eagle_aux_hidden_state_layer_ids": aux,
        }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    return path
