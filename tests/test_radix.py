"""Radix tree: matching, splitting, locking and LRU eviction; properties under random use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.cache.pool import PageAllocator
from tierserve.cache.radix import RadixCache


def make(page_size: int, num_pages: int = 64) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(page_size, alloc.free), alloc


def insert_new(tree: RadixCache, alloc: PageAllocator, tokens: list[int]) -> None:
    pages = alloc.alloc(len(tokens) // tree.page_size)
    assert pages is not None
    present, _ = tree.insert(tokens, pages)
    alloc.free(pages[: present // tree.page_size])  # duplicates of what the tree holds


def test_match_is_page_aligned_and_splits_nodes():
    tree, alloc = make(page_size=2)
    insert_new(tree, alloc, [1, 2, 3, 4, 5, 6])
    m = tree.match_prefix([1, 2, 3, 9, 9, 9])
    assert len(m.device_pages) == 1  # only the first whole page matches
    assert m.device_node.key == (1, 2)
    assert sorted(len(n.key) for n in tree.nodes()) == [2, 4]
    full = tree.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_pages
    assert len(full) == 3 and full[:1] == m.device_pages


def test_insert_reports_the_prefix_already_held():
    tree, alloc = make(page_size=1)
    insert_new(tree, alloc, [1, 2, 3])
    pages = alloc.alloc(5)
    assert tree.insert([1, 2, 3, 4, 5], pages)[0] == 3
    assert tree.num_pages == 5


def test_locked_nodes_survive_eviction_and_lru_goes_first():
    tree, alloc = make(page_size=1, num_pages=16)
    for seq in ([1, 2, 3], [4, 5], [6, 7, 8]):
        insert_new(tree, alloc, seq)
    locked = tree.match_prefix([4, 5]).device_node
    tree.lock(locked)
    tree.match_prefix([6, 7, 8])  # touched after [1, 2, 3]: [1, 2, 3] is least recent
    assert tree.evict(1) == 3
    assert tree.match_prefix([1, 2, 3]).device_pages == []
    assert tree.evict(100) == 3  # everything unlocked
    assert tree.match_prefix([4, 5]).device_pages != []
    tree.unlock(locked)
    assert tree.evict(100) == 2
    assert alloc.num_free == 16 and tree.num_pages == 0


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "lock", "unlock", "evict"]),
        st.lists(st.integers(0, 3), min_size=0, max_size=12),
        st.integers(0, 8),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), steps=ops)
def test_tree_properties_under_random_operations(page_size, steps):
    tree, alloc = make(page_size, num_pages=200)
    held = []
    for op, tokens, n in steps:
        tokens = tokens[: len(tokens) // page_size * page_size]
        if op == "insert" and alloc.num_free * page_size >= len(tokens):
            insert_new(tree, alloc, tokens)
        elif op == "lock":
            node = tree.match_prefix(tokens).device_node
            tree.lock(node)
            held.append(node)
        elif op == "unlock" and held:
            tree.unlock(held.pop(n % len(held)))
        elif op == "evict":
            tree.evict(n)
        check_invariants(tree, alloc)
    for node in held:
        tree.unlock(node)
    tree.evict(tree.num_pages)
    assert alloc.num_free == 200 and tree.num_pages == 0


def check_invariants(tree: RadixCache, alloc: PageAllocator) -> None:
    nodes = list(tree.nodes())
    pages = [p for n in nodes for p in n.pages]
    assert len(pages) == len(set(pages)), "a page is in two nodes"
    assert len(pages) == tree.num_pages
    assert alloc.num_free + len(pages) == alloc.num_pages
    locked = sum(len(n.pages) for n in nodes if n.lock_ref > 0)
    assert locked == tree.locked_pages
    for n in nodes:
        assert len(n.key) == len(n.pages) * tree.page_size and n.key
        assert n.parent.children[n.key[: tree.page_size]] is n
        # A locked node's ancestors are locked at least as often (locks cover paths).
        if n.parent is not tree.root:
            assert n.parent.lock_ref >= n.lock_ref


# --- the tree with a host tier ----------------------------------------------------------------

import torch  # noqa: E402

from tierserve.cache.pool import PagedKV  # noqa: E402
from tierserve.cache.tiers import HostTier  # noqa: E402
from tierserve.cache.transfer import ImmediateTransfer  # noqa: E402
from tierserve.sizing.kv import KVSpec  # noqa: E402


class TwoTiers:
    """A radix tree over a tiny device pool and host pool whose KV values encode the token and
    its position, so any page that lands in the wrong place is caught."""

    def __init__(self, page_size: int, policy: str, device_pages: int = 24, host_pages: int = 40):
        spec = KVSpec("kv", num_layers=2, heads=1, dim=1, dtype="float32", page_size=page_size)
        cpu = torch.device("cpu")
        self.device = PagedKV(spec, device_pages, cpu)
        host_pool = PagedKV(spec, host_pages, cpu, host_tier=True)
        transfer = ImmediateTransfer(self.device, host_pool)
        self.host = HostTier(host_pool, policy, transfer)
        self.alloc = PageAllocator(device_pages)
        self.tree = RadixCache(page_size, self.alloc.free, self.host.allocator.free)
        self.host.radix = self.tree
        self.ps = page_size

    def device_alloc(self, n: int) -> list[int] | None:
        for _ in range(2):  # a second pass once copies in flight have landed
            if self.alloc.num_free < n:
                self.tree.evict(n - self.alloc.num_free, before_drop=self.host.before_device_drop)
            if self.alloc.num_free >= n or not self.host.has_pending():
                break
            self.host.drain()
        return self.alloc.alloc(n)

    def values(self, slots: torch.Tensor) -> torch.Tensor:
        """Layer 1's V of `slots`, the one head's one element."""
        return self.device.data[slots // self.ps, 1, 1, 0, slots % self.ps, 0]

    def insert(self, tokens: list[int]) -> None:
        pages = self.device_alloc(len(tokens) // self.ps)
        if not pages:
            return
        slots = (torch.tensor(pages)[:, None] * self.ps + torch.arange(self.ps)).flatten()
        values = torch.tensor([t * 1000.0 + p for p, t in enumerate(tokens)])
        self.device.data[slots // self.ps, :, :, 0, slots % self.ps, 0] = values[:, None, None]
        present, node = self.tree.insert(tokens, pages)
        self.alloc.free(pages[: present // self.ps])
        self.host.after_insert(node)
        self.host.issue()

    def match_and_load(self, tokens: list[int]) -> None:
        m = self.tree.match_prefix(tokens)
        deepest = m.host_nodes[-1] if m.host_nodes else m.device_node
        self.tree.lock(deepest)
        pages = list(m.device_pages)
        loaded = self.device_alloc(m.host_page_count) if m.host_nodes else None
        if loaded is not None:
            _, loaded = self.host.load_back(m.host_nodes, loaded)
            self.host.issue()
            pages += loaded
        slots = torch.tensor(pages, dtype=torch.long)[:, None] * self.ps + torch.arange(self.ps)
        got = self.values(slots.flatten())
        want = torch.tensor([t * 1000.0 + p for p, t in enumerate(tokens[: len(got)])])
        assert torch.equal(got, want), "KV came back from the wrong pages"
        self.tree.record_hit_path(deepest)
        self.host.backup_hot(deepest)
        self.tree.unlock(deepest)


tier_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "evict", "evict_host", "lock", "unlock"]),
        st.lists(st.integers(0, 2), min_size=0, max_size=16),
        st.integers(0, 10),
    ),
    max_size=50,
)


@settings(max_examples=120, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    steps=tier_ops,
)
def test_two_tier_tree_properties(page_size, policy, steps):
    t = TwoTiers(page_size, policy)
    held = []
    for op, tokens, n in steps:
        tokens = tokens[: len(tokens) // page_size * page_size]
        if op == "insert":
            t.insert(tokens)
        elif op == "match":
            t.match_and_load(tokens)
        elif op == "evict":
            t.tree.evict(n, before_drop=t.host.before_device_drop)
        elif op == "evict_host":
            t.tree.evict_host(n)
        elif op == "lock":
            m = t.tree.match_prefix(tokens)
            t.tree.lock(m.device_node)
            held.append(m.device_node)
        elif held:
            t.tree.unlock(held.pop(n % len(held)))
        t.host.poll()
        check_two_tiers(t)
    for node in held:
        t.tree.unlock(node)
    t.host.drain()
    t.tree.reset()
    assert t.alloc.num_free == t.alloc.num_pages
    assert t.host.allocator.num_free == t.host.allocator.num_pages


def check_two_tiers(t: TwoTiers) -> None:
    tree, root = t.tree, t.tree.root
    nodes = list(tree.nodes())
    device = [p for n in nodes if n.on_device for p in n.pages]
    host = [p for n in nodes if n.host_pages is not None for p in n.host_pages]
    assert len(device) == len(set(device)) and len(host) == len(set(host))
    assert len(device) == tree.num_pages == t.alloc.num_pages - t.alloc.num_free
    assert len(host) == tree.host_pages == t.host.used_pages
    assert sum(len(n.pages) for n in nodes if n.on_device and n.lock_ref) == tree.locked_pages
    for n in nodes:
        assert n.on_device or n.host_pages is not None, "a node with KV nowhere"
        if n.parent is not root:
            assert not n.on_device or n.parent.on_device, "device copies must form a prefix"
            assert n.host_pages is None or n.parent.host_pages is not None, "host prefix"
            assert n.parent.lock_ref >= n.lock_ref
        if n.host_pages is not None and n.on_device:
            assert len(n.host_pages) == len(n.pages)


def test_load_back_page_table_follows_the_tree_whatever_order_pages_come_in():
    """The copy may pair pages in any order for longer runs; the page table it returns must be
    the tree's, in prefix order, or a request would read another position's KV."""
    t = TwoTiers(page_size=2, policy="write_through", device_pages=24, host_pages=40)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    t.insert(tokens)
    t.host.poll()
    t.tree.evict(t.tree.evictable_pages)  # only the host copy is left
    m = t.tree.match_prefix(tokens)
    assert m.device_pages == [] and m.host_page_count == 4
    fresh = t.alloc.alloc(4)[::-1]  # descending: the copy will reorder them
    op, pages = t.host.load_back(m.host_nodes, fresh)
    t.host.issue()
    assert op.landed and sorted(pages) == sorted(fresh)
    assert pages == [p for n in m.host_nodes for p in n.pages]
    slots = torch.tensor(pages)[:, None] * 2 + torch.arange(2)
    want = torch.tensor([tok * 1000.0 + pos for pos, tok in enumerate(tokens)])
    assert torch.equal(t.values(slots.flatten()), want)


@settings(max_examples=200, deadline=None)
@given(
    src=st.lists(st.integers(0, 60), min_size=1, max_size=40, unique=True),
    seed=st.integers(0, 1000),
    bounded=st.booleans(),
)
def test_matched_runs_is_a_pairing_that_keeps_runs(src, seed, bounded):
    import random

    from tierserve.cache import tiers

    rng = random.Random(seed)
    # Half the cases: one block of free pages, handed out shuffled.
    fresh = list(range(100, 100 + len(src))) if seed % 2 else rng.sample(range(100, 200), len(src))
    rng.shuffle(fresh)
    old = tiers.MATCH_WORK
    tiers.MATCH_WORK = 0 if bounded else old  # 0: the by-rank fallback
    try:
        out = tiers.matched_runs(src, fresh)
    finally:
        tiers.MATCH_WORK = old
    assert sorted(out) == sorted(fresh)  # every fresh page used once
    if not bounded and sorted(fresh) == list(range(100, 100 + len(fresh))):
        # one free run: every consecutive source pair lands consecutively
        for i in range(len(src) - 1):
            if src[i + 1] == src[i] + 1:
                assert out[i + 1] == out[i] + 1
