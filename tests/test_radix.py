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
    present = tree.insert(tokens, pages)
    alloc.free(pages[: present // tree.page_size])  # duplicates of what the tree holds


def test_match_is_page_aligned_and_splits_nodes():
    tree, alloc = make(page_size=2)
    insert_new(tree, alloc, [1, 2, 3, 4, 5, 6])
    pages, node = tree.match_prefix([1, 2, 3, 9, 9, 9])
    assert len(pages) == 1  # only the first whole page matches
    assert node.key == (1, 2)
    assert sorted(len(n.key) for n in tree.nodes()) == [2, 4]
    full, _ = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert len(full) == 3 and full[:1] == pages


def test_insert_reports_the_prefix_already_held():
    tree, alloc = make(page_size=1)
    insert_new(tree, alloc, [1, 2, 3])
    pages = alloc.alloc(5)
    assert tree.insert([1, 2, 3, 4, 5], pages) == 3
    assert tree.num_pages == 5


def test_locked_nodes_survive_eviction_and_lru_goes_first():
    tree, alloc = make(page_size=1, num_pages=16)
    for seq in ([1, 2, 3], [4, 5], [6, 7, 8]):
        insert_new(tree, alloc, seq)
    _, locked = tree.match_prefix([4, 5])
    tree.lock(locked)
    tree.match_prefix([6, 7, 8])  # touched after [1, 2, 3]: [1, 2, 3] is least recent
    assert tree.evict(1) == 3
    assert tree.match_prefix([1, 2, 3])[0] == []
    assert tree.evict(100) == 3  # everything unlocked
    assert tree.match_prefix([4, 5])[0] != []
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
            _, node = tree.match_prefix(tokens)
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
