"""The CPU paged attention kernel (`--attention-backend cpu`) against the torch backend, its
oracle, on the same pool: GQA and MLA, a sliding window, float32, bf16, fp16 and fp8 KV, page sizes
1 and 16, ragged lengths, 1 to 5 query tokens per sequence (and a span long enough for SDPA); and
the layer ops the same library fuses (RMSNorm, rotary, the KV store) against their torch code."""

from __future__ import annotations

import random

import pytest
import torch

from tierserve.cache import PagedKV
from tierserve.layers.attention import TorchAttention
from tierserve.layers.forward_batch import ForwardBatch, SeqSpan
from tierserve.layers.mla import MLA, MLAConfig
from tierserve.layers.mlp import GatedMLP
from tierserve.layers.norm import RMSNorm
from tierserve.layers.paged_attention import CPUPagedAttention
from tierserve.layers.rotary import RotaryEmbedding
from tierserve.sizing import KVSpec

LAYERS = 2
# (new query tokens, context length incl. them) per sequence: decode rows, verification-like
# blocks of 2-5, a prefix-less block, a turn added to a cached context, prompts whose rows the
# kernel takes in several chunks (one with a prefix, one across a split of its context), and
# one span past the kernel's limit (SDPA's, as torch).
SPANS = [(1, 1), (1, 17), (1, 40), (1, 100), (2, 2), (3, 33), (4, 16), (5, 71), (20, 57)]
SPANS += [(48, 130), (90, 90), (100, 300), (150, 700)]
SPANS += [(CPUPagedAttention.MAX_KERNEL_QUERIES + 4, CPUPagedAttention.MAX_KERNEL_QUERIES + 14)]


def _batch(pool: PagedKV, spans: list[tuple[int, int]], seed: int) -> ForwardBatch:
    """Sequences on shuffled pages (as a long-running pool hands them out), decode rows first
    as the runner lays them out."""
    rng = random.Random(seed)
    ps = pool.page_size
    free = list(range(pool.num_pages))
    rng.shuffle(free)
    out, slots, positions = [], [], []
    q_start = 0
    for i, (q_len, kv_len) in enumerate(sorted(spans)):
        pages = [free.pop() for _ in range(-(-kv_len // ps))]
        out.append(SeqSpan(i, q_start, q_len, kv_len, pages))
        for pos in range(kv_len - q_len, kv_len):
            slots.append(pages[pos // ps] * ps + pos % ps)
            positions.append(pos)
        q_start += q_len
    return ForwardBatch(
        input_ids=torch.zeros(q_start, dtype=torch.long),
        positions=torch.tensor(positions),
        out_slots=torch.tensor(slots),
        spans=out,
    )


def _fill_context(pool: PagedKV, batch: ForwardBatch, parts: int, seed: int) -> None:
    """Random cached KV for every context position before each span's new tokens."""
    g = torch.Generator().manual_seed(seed)
    ps, spec = pool.page_size, pool.spec
    for layer in range(LAYERS):
        for s in batch.spans:
            cached = s.kv_len - s.q_len
            if cached == 0:
                continue
            slots = torch.tensor([int(s.pages[p // ps]) * ps + p % ps for p in range(cached)])
            xs = [torch.randn(cached, spec.heads, spec.dim, generator=g) for _ in range(parts)]
            pool.write(layer, slots, *(x.to(pool.compute_dtype) for x in xs))


def _pool(kind: str, heads: int, dim: int, kv_dtype: str, page_size: int, compute: torch.dtype):
    spec = KVSpec(kind, LAYERS, heads, dim, kv_dtype, page_size)  # type: ignore[arg-type]
    pages = sum(-(-n // page_size) for _, n in SPANS) + 3
    return PagedKV(spec, pages, torch.device("cpu"), compute_dtype=compute)


KV_CASES = [
    ("float32", torch.float32, 1e-5),
    ("bfloat16", torch.float32, 1e-5),  # stored bf16, attended in float32
    ("float16", torch.float32, 1e-5),
    ("fp8_e4m3", torch.float32, 1e-5),
    ("fp8_e5m2", torch.float32, 1e-5),
    ("float16", torch.float16, 3e-3),  # a float16 model: the kernel attends its rows in float32
    ("bfloat16", torch.bfloat16, 3e-2),  # a bf16 model: the torch path computes in bf16
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kv_dtype", "compute", "tol"), KV_CASES)
@pytest.mark.parametrize("window", [None, 7])
def test_gqa_equals_the_torch_path(page_size, kv_dtype, compute, tol, window):
    _check_gqa(8, 2, 32, page_size, kv_dtype, compute, tol, window)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (14, 2, 128)])
@pytest.mark.parametrize("page_size", [8, 32])
@pytest.mark.parametrize(("kv_dtype", "compute", "tol"), [KV_CASES[0], KV_CASES[-1]])
def test_other_head_sizes_and_groups_equal_the_torch_path(
    heads, kv_heads, dim, page_size, kv_dtype, compute, tol
):
    """The kernel's other compiled head sizes, whose rows' value sums go 2 and 1 at a time
    (groups of 3 and 7 leave a partial tile), on pages that are half and twice its 16 keys
    a score tree."""
    _check_gqa(heads, kv_heads, dim, page_size, kv_dtype, compute, tol, window=None)


def _check_gqa(heads, kv_heads, dim, page_size, kv_dtype, compute, tol, window):
    pool = _pool("kv", kv_heads, dim, kv_dtype, page_size, compute)
    batch = _batch(pool, SPANS, seed=page_size)
    _fill_context(pool, batch, parts=2, seed=1)
    g = torch.Generator().manual_seed(2)
    tokens = len(batch.input_ids)
    q = torch.randn(tokens, heads, dim, generator=g).to(compute)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=g).to(compute) for _ in range(2))
    got, want = [], []
    for backend, outs in (
        (CPUPagedAttention(pool, LAYERS), got),
        (TorchAttention(pool, LAYERS), want),
    ):
        backend.prepare(batch)
        for layer in range(LAYERS):
            outs.append(backend.forward(layer, q, k, v, window=window))
    for layer in range(LAYERS):
        assert got[layer].dtype == compute
        torch.testing.assert_close(got[layer], want[layer], atol=tol, rtol=tol)
    assert not torch.equal(got[0], got[1])  # the layers' contexts differ: each was read


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_mla_in_the_latent_space_equals_the_torch_path(page_size, kv_dtype):
    cfg = MLAConfig(
        hidden_size=64,
        num_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        scaling=24**-0.5,
    )
    torch.manual_seed(3)
    mla = MLA(cfg)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    pool = _pool("latent", 1, width, kv_dtype, page_size, torch.float32)
    batch = _batch(pool, SPANS, seed=page_size + 1)
    _fill_context(pool, batch, parts=1, seed=4)
    g = torch.Generator().manual_seed(5)
    tokens = len(batch.input_ids)
    q_nope = torch.randn(tokens, cfg.num_heads, cfg.qk_nope_head_dim, generator=g)
    q_rope = torch.randn(tokens, cfg.num_heads, cfg.qk_rope_head_dim, generator=g)
    latent = torch.randn(tokens, width, generator=g)
    outs = []
    with torch.no_grad():
        for backend in (CPUPagedAttention(pool, LAYERS), TorchAttention(pool, LAYERS)):
            backend.prepare(batch)
            outs.append(backend.forward_latent(1, mla, q_nope, q_rope, latent))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_a_long_context_is_split_and_merged_the_same_in_any_batch_and_thread_count():
    """Batch 1 over a long context: the kernel splits it (every 512 tokens) and merges the
    parts, equal to the torch path; and a sequence's result is the same bits whatever else is
    in the batch and however many threads run it, so greedy outputs cannot depend on batching
    through attention."""
    spec = KVSpec("kv", LAYERS, 2, 32, "float32", 16)
    pool = PagedKV(spec, 300, torch.device("cpu"))
    spans = [(1, 1500), (3, 900), (1, 40), (2, 600)]
    batch = _batch(pool, spans, seed=9)
    _fill_context(pool, batch, parts=2, seed=10)
    g = torch.Generator().manual_seed(11)
    tokens = len(batch.input_ids)
    q = torch.randn(tokens, 8, 32, generator=g)
    k, v = torch.randn(tokens, 2, 32, generator=g), torch.randn(tokens, 2, 32, generator=g)
    want = TorchAttention(pool, LAYERS)
    want.prepare(batch)
    reference = want.forward(0, q, k, v)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = CPUPagedAttention(pool, LAYERS)
            got.prepare(batch)
            outs.append(got.forward(0, q, k, v))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], reference, atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0], outs[1])
    # The longest sequence alone (the same pages, its rows of q) gives the same bits.
    longest = max(batch.spans, key=lambda s: s.kv_len)
    rows = slice(longest.q_start, longest.q_start + longest.q_len)
    alone = ForwardBatch(
        batch.input_ids[rows],
        batch.positions[rows],
        batch.out_slots[rows],
        [SeqSpan(0, 0, longest.q_len, longest.kv_len, longest.pages)],
    )
    single = CPUPagedAttention(pool, LAYERS)
    single.prepare(alone)
    assert torch.equal(single.forward(0, q[rows], k[rows], v[rows]), outs[0][rows])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page_size", "kv_dtype", "compute"),
    [
        (8, 2, 32, 16, "float32", torch.float32),
        (8, 2, 32, 1, "float32", torch.float32),
        (8, 2, 32, 16, "fp8_e4m3", torch.float32),
        (8, 2, 32, 16, "bfloat16", torch.bfloat16),
        (6, 2, 64, 8, "float32", torch.float32),
        (4, 2, 64, 16, "bfloat16", torch.bfloat16),
    ],
)
def test_a_prompts_rows_are_the_same_bits_as_decoding_its_tokens_one_by_one(
    heads, kv_heads, dim, page_size, kv_dtype, compute
):
    """A span of new tokens (a prompt after a cached prefix, in several row chunks and across
    a split of its context) gives each token the same bits as that token decoded alone over
    the same KV. Speculative verification, prefix-cache hits and chunked prefill all compute a
    token's attention in one path where plain decoding used the other: their greedy outputs
    stay equal only if the two paths agree to the bit."""
    spec = KVSpec("kv", LAYERS, kv_heads, dim, kv_dtype, page_size)  # type: ignore[arg-type]
    pool = PagedKV(spec, -(-700 // page_size) + 2, torch.device("cpu"), compute_dtype=compute)
    batch = _batch(pool, [(300, 700)], seed=31)
    _fill_context(pool, batch, parts=2, seed=32)
    g = torch.Generator().manual_seed(33)
    q = torch.randn(300, heads, dim, generator=g).to(compute)
    k, v = (torch.randn(300, kv_heads, dim, generator=g).to(compute) for _ in range(2))
    backend = CPUPagedAttention(pool, LAYERS)
    backend.prepare(batch)
    span = backend.forward(0, q, k, v)
    (seq,) = batch.spans
    for i in range(300):
        one = slice(i, i + 1)
        kv_len = seq.kv_len - seq.q_len + i + 1
        alone = ForwardBatch(
            batch.input_ids[one],
            batch.positions[one],
            batch.out_slots[one],
            [SeqSpan(0, 0, 1, kv_len, seq.pages[: -(-kv_len // page_size)])],
        )
        backend.prepare(alone)
        assert torch.equal(backend.forward(0, q[one], k[one], v[one]), span[one]), i


@pytest.mark.parametrize(
    ("kv_dtype", "model_dtype"),
    [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")],
)
def test_the_fused_layer_ops_equal_their_torch_code(kv_dtype, model_dtype):
    """RMSNorm, rotary, the KV store and the gated MLP's SiLU x up as the CPU backend runs them
    (layer_ops.cpp) against the torch code they replace, on the strided views a packed GEMM
    hands them; the backend's `adopt` turns them on for a model's modules. A bf16 model's rows
    are computed in float32 and rounded once, as torch's path does: at most one bf16 ulp apart
    where torch's float32 arithmetic rounds differently, and nearly every value the same
    bits."""
    tokens, heads, kv_heads, dim = 7, 4, 2, 32
    spec, stored = KVSpec("kv", LAYERS, kv_heads, dim, kv_dtype, 4), getattr(torch, kv_dtype)
    rows = getattr(torch, model_dtype)
    pools = [PagedKV(spec, 6, torch.device("cpu"), compute_dtype=rows) for _ in range(2)]
    batch = _batch(pools[0], [(3, 5), (4, 9)], seed=13)
    backend = CPUPagedAttention(pools[0], LAYERS)
    backend.prepare(batch)
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(rows)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (x.view(tokens, -1, dim) for x in (q, k, v))  # strided, as the model's are
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = torch.randn(dim, generator=g).to(rows)
    rotary = RotaryEmbedding(dim, 64, 10000.0, None)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    mlp = GatedMLP(dim, 3 * dim).to(rows)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=g).to(rows)  # gate values past +-20: e^x's ends
    mlp.down_proj = torch.nn.Identity()  # compared at SiLU(gate) x up, before a sum blurs it
    outs = {}
    for kernel in (False, True):
        norm.kernel = rotary.kernel = mlp.kernel = kernel
        rq, rk = rotary(positions, q.clone(), k.clone())
        outs[kernel] = (norm(q), norm(qkv[:, :dim]), rq, rk, mlp(qkv[:, :dim]))
    ulp = 2**-7 if rows == torch.bfloat16 else 1e-5  # bf16 keeps 8 significant bits
    for got, want in zip(outs[True], outs[False], strict=True):
        assert got.dtype == want.dtype == rows
        torch.testing.assert_close(got, want, atol=1e-6, rtol=ulp)
        if rows == torch.bfloat16:
            assert (got == want).float().mean() > 0.95
    k, v = k.to(stored), v.to(stored)
    backend._write(1, k, v)
    pools[1].write(1, batch.out_slots, k, v)
    assert torch.equal(pools[0].data, pools[1].data) and pools[0].data.any()
    model = torch.nn.Sequential(RMSNorm(dim, 1e-6), rotary, mlp)
    rotary.kernel = mlp.kernel = False
    backend.adopt(model)
    assert model[0].kernel and rotary.kernel and mlp.kernel


def test_a_bf16_models_queries_and_output_match_converting_around_the_kernel():
    """The kernel reads a bf16 model's queries and writes its output in bf16 (no float32
    copies around the call): the same bits as widening q first and rounding the output after,
    for GQA rows (each head size the kernel knows; prompts too) and for MLA's latent width (no
    fixed head size). On a CPU with AVX512-BF16, GQA's bf16 queries are scored as they lie
    (exact products, the scale after the sum): their output is within a bf16 rounding of the
    widened one's, nearly every value the same bits."""
    shapes = ((8, 2, 32, 32), (4, 2, 64, 64), (2, 1, 128, 128), (4, 1, 40, 32))
    for heads, kv_heads, dim, v_dim in shapes:
        gqa = v_dim == dim  # else MLA's latent
        pool = _pool("kv" if gqa else "latent", kv_heads, dim, "bfloat16", 16, torch.bfloat16)
        most = CPUPagedAttention.MAX_KERNEL_QUERIES if gqa else CPUPagedAttention.MAX_LATENT_QUERIES
        batch = _batch(pool, [s for s in SPANS if s[0] <= most], seed=21)  # the kernel's spans
        _fill_context(pool, batch, parts=2 if gqa else 1, seed=22)
        backend = CPUPagedAttention(pool, LAYERS)
        backend.prepare(batch)
        g = torch.Generator().manual_seed(23)
        q = torch.randn(len(batch.input_ids), heads, dim, generator=g).to(torch.bfloat16)
        v_part = 1 if gqa else 0
        widens = not torch.ops.tierserve.bf16_scores()  # the op: loaded by the backend
        got = backend._kernel(1, q, 0, v_part, v_dim, None, dim**-0.5)
        widened = backend._kernel(1, q.float(), 0, v_part, v_dim, None, dim**-0.5)
        assert got.dtype == torch.bfloat16 and widened.dtype == torch.float32
        assert got.float().abs().sum() > 0
        if widens or not gqa:
            assert torch.equal(got, widened.to(torch.bfloat16))
        else:
            torch.testing.assert_close(got.float(), widened, atol=1e-6, rtol=2**-8)
            assert (got == widened.to(torch.bfloat16)).float().mean() > 0.95


def test_the_backend_is_decided_at_start_up():
    """`auto` is the kernel on CPU (make built it) and torch elsewhere; `cpu` on another device
    is refused by start-up's decision, before any weight or pool exists."""
    from tierserve.errors import TierserveError
    from tierserve.layers import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(TierserveError, match="runs on CPU, not cuda"):
        resolve_backend("cpu", torch.device("cuda"))


def test_auto_says_when_the_kernels_are_not_built(tmp_path, monkeypatch, caplog):
    """A kernel source edited or torch upgraded since the last build: `auto` serves with the
    torch backend and says why and how to build, instead of running slower without a word."""
    import logging

    from tierserve.layers import kernels, resolve_backend

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a cache with no build in it
    monkeypatch.setattr(kernels, "_loaded", False)
    with caplog.at_level(logging.WARNING, logger="tierserve"):
        assert resolve_backend("auto", torch.device("cpu")) == "torch"
    (record,) = [r for r in caplog.records if "not built" in r.getMessage()]
    assert str(tmp_path) in record.getMessage()
    assert "python -m tierserve.layers.kernels" in record.getMessage()
    assert not list(tmp_path.rglob("*.so"))  # auto never builds at a plain start
