"""The suite's scheduling holds: under `--dist loadgroup` (scripts/test) a test of a group carries the group
in its id, which is all pytest-xdist schedules by. pytest 9.2 with pytest-xdist 3.8 dropped it silently
(xdist renames `item._nodeid`, pytest 9.2 reads `nodeid` from elsewhere), so every shared vLLM server,
dockerd and Ray cluster was started on both workers; pyproject.toml pins pytest below 9.2 for that."""

from __future__ import annotations

import pytest


@pytest.mark.vllm  # one of tests/conftest.XDIST_GROUPS, as the real parts' tests are
def test_a_grouped_test_carries_its_group_in_its_id(request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not a worker of --dist loadgroup (run by scripts/test)")
    assert request.node.nodeid.endswith("@vllm"), (
        f"{request.node.nodeid}: pytest-xdist's loadgroup did not take effect with this pytest; each group "
        "would run on every worker (pin the pair pyproject.toml names)"
    )
