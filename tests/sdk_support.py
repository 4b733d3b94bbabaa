"""What the SDK end-to-end tests check on every call: the records equal what the fake server saw and sampled.

`Sampler` scripts the fake inference server and keeps every body it answered with, so a test can compare a
record against the exact token data the server sent; `check_records` does that for a whole session and
recomputes the same data independently with the fake's tokenizer and logprob function.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from polar.store.records import CompletionRecord
from tests.conftest import SERVED_MODEL, FakeBackend, Gateway, start_gateway
from tests.fakes.chatml import IM_END, FakeTokenizer, assistant_text, logprob
from tests.fakes.fake_vllm import Reply, make_fake_backend
from tests.fakes.server import serve

TOKENIZER = FakeTokenizer()


def serve_stack(tmp: Path) -> Iterator[tuple[FakeBackend, Gateway]]:
    """A fake vLLM and a gateway in front of it, for a whole module: tests take a fresh session each and
    `Sampler` resets the fake, so sharing them only saves the servers' start and stop."""
    app = make_fake_backend("vllm")
    with serve(app) as srv:
        gw = start_gateway(srv.url, tmp)
        try:
            yield FakeBackend(srv.url, app), gw
        finally:
            gw.server.stop()


class Sampler:
    """Scripts the fake with `replies` (in order) and records each chat body it answers with."""

    def __init__(self, backend: FakeBackend, *replies: Reply) -> None:
        self.fake = backend.app
        self.replies = list(replies)
        self.answers: list[dict[str, Any]] = []
        self.fake.reset(self.replies, transform=self._keep)

    def _keep(self, out: dict[str, Any]) -> dict[str, Any]:
        self.answers.append(out)
        return out

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every chat body the fake received, in order."""
        return list(self.fake.requests)


def prompt_ids(upstream: dict[str, Any]) -> list[int]:
    """The fake tokenizer's encoding of an upstream chat body (what the server renders and tokenizes)."""
    return TOKENIZER.encode(TOKENIZER.render(upstream["messages"], upstream.get("tools")))


def sampled_ids(reply: Reply) -> list[int]:
    """The ids the fake samples for `reply` when no token limit cuts it: the turn's text and `<|im_end|>`."""
    return [*TOKENIZER.encode(assistant_text(reply.content, reply.reasoning, reply.tool_calls)), IM_END]


def check_records(
    gw: Gateway, sid: str, sampler: Sampler, *, dialect: str, model: str
) -> list[CompletionRecord]:
    """Every record of `sid` against the fake's requests and answers, one for one; returns the records."""
    recs = gw.completions(sid)
    assert recs == gw.stored(sid)  # the control plane serves what the SQLite file holds
    assert [r.seq for r in recs] == list(range(len(recs)))
    requests = sampler.requests
    assert len(recs) == len(requests) == len(sampler.answers)
    for rec, upstream, answer, reply in zip(recs, requests, sampler.answers, sampler.replies, strict=True):
        choice = answer["choices"][0]
        assert rec.dialect == dialect
        assert rec.model_requested == model and rec.model_served == SERVED_MODEL
        assert rec.upstream_request == upstream
        assert rec.prompt_ids == answer["prompt_token_ids"] == prompt_ids(upstream)
        assert rec.response_ids == choice["token_ids"] == sampled_ids(reply)
        assert rec.response_logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
        assert rec.response_logprobs == [logprob(p, t) for p, t in enumerate(rec.response_ids)]
        assert rec.finish_reason == choice["finish_reason"]
        assert rec.usage == {"prompt_tokens": len(rec.prompt_ids), "completion_tokens": len(rec.response_ids)}
        assert rec.trainable and rec.flags == ()
    return recs


def check_prefix_chain(recs: Sequence[CompletionRecord]) -> None:
    """Each call's prompt extends the previous prompt plus what was sampled, token for token."""
    assert len(recs) >= 2
    for prev, nxt in pairwise(recs):
        assert prev.prompt_ids is not None and prev.response_ids is not None and nxt.prompt_ids is not None
        head = prev.prompt_ids + prev.response_ids
        assert len(nxt.prompt_ids) > len(head)
        assert nxt.prompt_ids[: len(head)] == head


def tool_messages(upstream: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in upstream["messages"] if m["role"] == "tool"]


def assistant_messages(upstream: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in upstream["messages"] if m["role"] == "assistant"]
