"""The gateway stamps the policy version the trainer resumed it with on records whose server reports none
(vLLM does not put one on its answers), and leaves a version the server reports alone."""

from __future__ import annotations

import httpx

from tests.conftest import FakeBackend, Gateway


def chat(gw: Gateway, sid: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {sid}"})
    assert r.status_code == 200, r.text


def test_resume_with_a_version_stamps_the_calls_after_it(gateway: Gateway, fake_backend: FakeBackend) -> None:
    sid = gateway.new_session()
    chat(gateway, sid)
    assert gateway.control("POST", "/admin/pause", params={"timeout": 5}).json()["drained"] is True
    r = gateway.control("POST", "/admin/resume", params={"policy_version": 3})
    assert r.status_code == 200 and r.json() == {"paused": False, "policy_version": 3}
    chat(gateway, sid)
    assert gateway.control("POST", "/admin/resume").json()["policy_version"] == 3  # a plain resume keeps it
    chat(gateway, sid)
    assert [r.policy_version for r in gateway.completions(sid)] == [None, 3, 3]

    fake_backend.app.policy_version = 9  # a server that reports its own version (our engine, SGLang) wins
    chat(gateway, sid)
    assert gateway.completions(sid)[-1].policy_version == 9


def test_resume_refuses_a_version_that_is_not_an_integer(gateway: Gateway) -> None:
    r = gateway.control("POST", "/admin/resume", params={"policy_version": "v2"})
    assert r.status_code == 400 and "policy_version must be an integer, not 'v2'" in r.text
