"""The body's nesting depth, counted on its bytes before anything parses it: equal to the depth
of the parsed JSON however the body is split into chunks, strings and escapes included."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.server.guards import JsonDepthGauge

# Strings full of what a naive bracket count would trip on.
TRICKY = st.text(alphabet='[]{}"\\ab\n', max_size=6)
VALUES = st.recursive(
    st.none() | st.integers() | TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
    max_leaves=30,
)


def depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


@settings(max_examples=400, deadline=None)
@given(VALUES, st.lists(st.integers(1, 7), min_size=1, max_size=40))
def test_the_gauge_counts_the_parsed_depth_whatever_the_chunks(value, sizes):
    body = json.dumps(value).encode()
    for limit in {max(0, depth(value) - 1), depth(value)}:
        gauge, at, ok = JsonDepthGauge(limit), 0, True
        for size in sizes * (len(body) // len(sizes) + 1):
            ok = gauge.feed(body[at : at + size]) and ok
            at += size
        assert ok == (depth(value) <= limit)


def test_a_deep_body_is_caught_without_reading_it_all():
    gauge = JsonDepthGauge(128)
    assert not gauge.feed(b'{"a":' * 129)
    assert gauge.too_deep
