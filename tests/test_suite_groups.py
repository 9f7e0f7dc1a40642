"""How `make test` runs on two workers (conftest.py): pytest-xdist's --dist loadgroup keeps each
file's tests, and the short-timeout files together, on one worker, so a file's module-scoped
server starts once. xdist learns a test's group from a suffix it writes into the test's node id;
where pytest does not keep that suffix (pytest 9.2 with xdist 3.8), every test is a group of its
own and nothing says so, but the suite runs its servers again and again."""

from __future__ import annotations

import pytest

from tests.conftest import TIMEOUT_FILES


def test_a_test_reaches_the_scheduler_with_its_files_group(request):
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not run with --dist loadgroup (make test runs it so)")
    name = request.node.path.name
    group = "timeouts" if name in TIMEOUT_FILES else name
    assert request.node.nodeid.endswith(f"@{group}"), request.node.nodeid
