"""Weight updates: in process and over HTTP, all or nothing, with policy_version on every response."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from polar.engine import Engine, SamplingParams
from tests.engine_support import reference_logprobs, tiny_server

MESSAGES = [{"role": "user", "content": "hello"}]


def _perturbed(engine: Engine, scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=g).to(v.device) if v.is_floating_point() else v.clone()
        for k, v in engine.model.state_dict().items()
    }


def _chat(url: str, model: str, **kw: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 6,
        "seed": 1,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 0,
        **kw,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_update_weights_in_process_and_over_http(tmp_path: Path) -> None:
    with tiny_server() as (engine, srv):
        before = _chat(srv.url, engine.name)
        assert before["policy_version"] == 0

        new = _perturbed(engine, 0.05, 1)
        assert engine.update_weights(new) == 1
        after = _chat(srv.url, engine.name)
        assert after["policy_version"] == 1
        assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
        choice = after["choices"][0]
        want = reference_logprobs(engine.model, after["prompt_token_ids"], choice["token_ids"])
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(want, abs=2e-3)

        # A checkpoint folder, as a trainer writes it with save_pretrained.
        engine.model.save_pretrained(tmp_path / "step-7")  # current weights, saved without tied lm_head
        r = httpx.post(
            srv.url + "/update_weights", json={"path": str(tmp_path / "step-7"), "policy_version": 7}
        )
        assert r.status_code == 200 and r.json()["policy_version"] == 7
        assert httpx.get(srv.url + "/policy_version").json() == {"policy_version": 7}
        again = _chat(srv.url, engine.name)
        assert again["policy_version"] == 7
        assert again["choices"][0]["token_ids"] == after["choices"][0]["token_ids"]
        assert _chat(srv.url, engine.name, stream=False)["usage"]["prompt_tokens_details"] is not None


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({}, "checkpoint directory is required"),
        ({"path": "/nonexistent/ckpt"}, "is not a directory"),
        ({"path": "EMPTY"}, "no *.safetensors"),
        ({"path": "WRONG"}, "shape mismatch"),
    ],
)
def test_bad_checkpoints_are_400_and_change_nothing(
    tmp_path: Path, payload: dict[str, str], needle: str
) -> None:
    with tiny_server() as (engine, srv):
        before = _chat(srv.url, engine.name)
        if payload.get("path") == "EMPTY":
            payload = {"path": str(tmp_path)}
        elif payload.get("path") == "WRONG":
            from safetensors.torch import save_file

            save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
            payload = {"path": str(tmp_path)}
        r = httpx.post(srv.url + "/update_weights", json=payload)
        assert r.status_code == 400
        err = r.json()["error"]
        assert needle in err["message"] and err["param"] == "path"
        after = _chat(srv.url, engine.name)
        assert after["policy_version"] == 0
        assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_in_flight_generation_finishes_on_the_old_weights() -> None:
    with tiny_server() as (engine, _):
        prompt = engine.tokenizer.encode("a long story")
        old_model_state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        new = _perturbed(engine, 0.05, 2)

        async def scenario() -> tuple[list[int], list[float], int, int]:
            ids: list[int] = []
            lps: list[float] = []
            version = -1
            gen = engine.generate(prompt, SamplingParams(max_tokens=60, seed=3))
            updated: dict[str, int] = {}
            async for upd in gen:
                ids += upd.token_ids
                lps += upd.logprobs
                version = upd.policy_version
                if len(ids) == 5:
                    t = threading.Thread(target=lambda: updated.setdefault("v", engine.update_weights(new)))
                    t.start()
            await asyncio.to_thread(t.join)
            return ids, lps, version, updated["v"]

        ids, lps, version, new_version = asyncio.run(scenario())
        assert len(ids) == 60 and version == 0 and new_version == 1
        current = {k: v.clone() for k, v in engine.model.state_dict().items()}
        engine.model.load_state_dict(old_model_state)
        want_old = reference_logprobs(engine.model, prompt, ids)
        engine.model.load_state_dict(current)
        assert lps == pytest.approx(want_old, abs=2e-3)
        assert engine.policy_version == 1
