"""Real harness CLIs against a real vLLM: mini-swe-agent (Python, Chat dialect) and Pi (npm, Chat and
Anthropic dialects) run unmodified in a node's local runtime, their model calls go through the gateway to
`vllm serve`, and every record holds exactly the prompt ids vLLM's own tokenizer gives for the body the
gateway sent, with one logprob per sampled id, and the session's trajectory audits clean.

The served model is the tool-calling test model (`tests.vllm_support`), not a capable agent: the runs end
when the harness gives up or its step limit is reached. What is proved is the capture, not the agent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.gateway.backends.base import BackendOptions
from polar.harness.registry import get_harness
from polar.store.sqlite import SQLiteStore
from polar.trajectory import build
from polar.trajectory.audit import audit
from tests.node_support import running_node, shell_task, spec
from tests.test_vllm_real import vllm_tokenize
from tests.vllm_support import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.cli]

HARNESSES = {
    "mini_swe_agent": {"mode": "tool_calls", "step_limit": 3, "model_kwargs": {"max_tokens": 64}},
    "pi": {"dialect": "chat", "max_tokens": 64, "context_window": 8192},
    "pi-anthropic": {"dialect": "anthropic", "max_tokens": 64, "context_window": 8192},
}


@pytest.mark.parametrize("name", list(HARNESSES))
async def test_a_real_harness_against_vllm_records_exact_tokens(
    name: str, vllm_server: VLLMServer, tmp_path: Path
) -> None:
    harness = name.split("-")[0]
    settings: dict[str, Any] = dict(HARNESSES[name])
    task = shell_task(
        "unused",
        instruction="Pick a color for the logo.",
        timeout_seconds=180,
        agent={"harness": harness, "settings": settings},
        runtime={"backend": "local", "network": "gateway"},
        evaluator={"strategy": "session_completed"},
    )
    get_harness(harness, settings)  # valid settings, before a node starts
    async with running_node(
        vllm_server.url,
        tmp_path,
        served_model=vllm_server.name,
        backend=BackendOptions(retries=0, timeout_s=120.0),
    ) as node:
        await node.submit(spec(task, "sess-vllm"))
        await node.wait("sess-vllm")
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions("sess-vllm")
    assert records, "the harness made no model call"
    assert {r.dialect for r in records} == {settings.get("dialect", "chat")}
    with httpx.Client(timeout=120) as http:
        for rec in records:
            assert rec.trainable, (rec.seq, rec.flags)
            assert rec.prompt_ids == vllm_tokenize(http, vllm_server, rec.upstream_request), rec.seq
            assert rec.response_ids and len(rec.response_ids) == len(rec.response_logprobs or [])
    trajectory = build(records, strategy="prefix_merging")
    report = audit(trajectory, records)
    assert report.ok, report
