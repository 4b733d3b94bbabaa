"""`render: gateway` on an SGLang server: token ids in through SGLang's native `/generate`, read back as
vLLM's `/v1/completions` answers (polar.gateway.render.sglang). The wire translation on SGLang's own shapes;
end to end through the stand-in for `/generate` (tests/fakes/sglang_generate.py: SGLang needs CUDA) in front
of the embedded engine, against the same engine rendered through `/v1/completions`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from polar.engine import Engine
from polar.gateway.errors import GatewayError
from polar.gateway.render.sglang import StreamReader, completion_of, generate_body
from polar.trajectory import build
from tests.conftest import Gateway, start_gateway
from tests.fakes.server import serve
from tests.fakes.sglang_generate import SGLangStandIn
from tests.test_gateway_faults import failures

# -- the wire, on SGLang's shapes ----------------------------------------------------------------------------


def test_the_generate_body_carries_the_prompt_ids_and_the_sampling_settings() -> None:
    wire = {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 20, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "stop": ["</s>"], "seed": 7, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True, "logprobs": 0, "skip_special_tokens": False, "user": "u", "n": 1,
        "presence_penalty": None,
    }  # fmt: skip
    assert generate_body(wire) == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 20, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "stop": ["</s>"],
            "sampling_seed": 7, "skip_special_tokens": False,
        },
        "stream": True,
        "return_logprob": True,
        "logprob_start_len": -1,
    }  # fmt: skip
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
    body = generate_body({"prompt": [1], "response_format": schema})
    assert body["sampling_params"] == {"json_schema": '{"type": "integer"}'}


@pytest.mark.parametrize(
    ("field", "value"), [("n", 2), ("best_of", 2), ("echo", True), ("response_format", {"type": "xml"})]
)
def test_a_setting_generate_cannot_honour_is_a_400_naming_it(field: str, value: Any) -> None:
    with pytest.raises(GatewayError) as err:
        generate_body({"prompt": [1], field: value})
    assert err.value.status == 400 and err.value.param == field


SAMPLED = {
    "text": " hello",
    "output_ids": [11, 12, 2],
    "meta_info": {
        "id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3,
        "completion_tokens": 3, "cached_tokens": 0, "weight_version": "4",
        "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None], [-0.125, 2, None]],
    },
}  # fmt: skip


def test_an_answer_reads_as_a_completions_answer() -> None:
    out = completion_of(SAMPLED, "m")
    (choice,) = out["choices"]
    assert choice["text"] == " hello" and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == [11, 12, 2]
    assert choice["logprobs"] == {"token_logprobs": [-0.5, -0.25, -0.125]}
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert out["policy_version"] == 4 and out["model"] == "m"


def test_ids_that_disagree_with_their_logprobs_are_left_out_to_be_flagged() -> None:
    broken = {**SAMPLED, "output_ids": [11, 12, 3]}
    choice = completion_of(broken, "m")["choices"][0]
    assert choice["token_ids"] is None and choice["logprobs"] is None
    missing = {**SAMPLED, "meta_info": {k: v for k, v in SAMPLED["meta_info"].items() if "logprobs" not in k}}
    assert completion_of(missing, "m")["choices"][0]["token_ids"] is None


@pytest.mark.parametrize("raw", [[], {"text": "x"}, {"error": {"message": "boom"}}])
def test_a_shapeless_answer_is_an_upstream_error(raw: Any) -> None:
    with pytest.raises(GatewayError) as err:
        completion_of(raw, "m")
    assert err.value.status == 502


def test_an_aborted_generation_is_an_upstream_error() -> None:
    aborted = {
        **SAMPLED,
        "meta_info": {**SAMPLED["meta_info"], "finish_reason": {"type": "abort", "message": "x"}},
    }
    with pytest.raises(GatewayError, match="aborted"):
        completion_of(aborted, "m")


def _events(incremental: bool) -> list[dict[str, Any]]:
    """SGLang's stream of SAMPLED: the answer so far in each event, or only what is new."""
    pieces = [(" he", [11]), ("llo", [12]), ("", [2])]
    events, text, ids = [], "", []
    for i, (t, new) in enumerate(pieces):
        text, ids = text + t, ids + new
        last = i == len(pieces) - 1
        entries = SAMPLED["meta_info"]["output_token_logprobs"]  # type: ignore[index]
        meta = {
            **SAMPLED["meta_info"],  # type: ignore[dict-item]
            "finish_reason": SAMPLED["meta_info"]["finish_reason"] if last else None,  # type: ignore[index]
            "completion_tokens": len(ids),
            "output_token_logprobs": entries[len(ids) - len(new) : len(ids)]
            if incremental
            else entries[: len(ids)],
        }
        events.append(
            {"text": t if incremental else text, "output_ids": new if incremental else ids, "meta_info": meta}
        )
    return events


@pytest.mark.parametrize("incremental", [False, True], ids=["whole-so-far", "incremental"])
def test_a_stream_reads_as_completions_chunks_of_what_is_new(incremental: bool) -> None:
    reader = StreamReader("m")
    chunks = [reader.chunk(e)["choices"][0] for e in _events(incremental)]
    assert [c["text"] for c in chunks] == [" he", "llo", ""]
    assert [c["token_ids"] for c in chunks] == [[11], [12], [2]]
    assert [c["logprobs"]["token_logprobs"] for c in chunks] == [[-0.5], [-0.25], [-0.125]]
    assert [c["finish_reason"] for c in chunks] == [None, None, "stop"]


# -- end to end: the stand-in for /generate in front of the embedded engine ----------------------------------


def _gateway(url: str, tmp_path: Path, name: str, engine: Engine, kind: str) -> Gateway:
    return start_gateway(
        url, tmp_path, store_path=tmp_path / f"{name}.db", served_model=engine.name, render="gateway",
        backend_kind=kind,
    )  # fmt: skip


CONVERSATION: list[Any] = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]


def _two_turns(gw: Gateway, stream: bool) -> list[Any]:
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    messages = list(CONVERSATION)
    for turn in range(2):
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model="m", messages=messages, max_tokens=8, temperature=0, stream=True
                )
            )
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            resp = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
            content = resp.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"more {turn}"}]
    return gw.completions(sid)


@pytest.mark.parametrize("incremental", [False, True], ids=["whole-so-far", "incremental"])
def test_sessions_rendered_for_sglang_are_the_vllm_routes_token_for_token(
    tiny: tuple[Engine, str], tmp_path: Path, incremental: bool
) -> None:
    """Greedy two-turn sessions, streamed and not: through /generate the same prompt ids, sampled ids and
    logprobs as through /v1/completions, each session one chain and one trainable trace."""
    engine, url = tiny
    stand_in = SGLangStandIn(url, incremental=incremental)
    got: dict[tuple[str, bool], list[Any]] = {}
    with serve(stand_in.app()) as sglang:
        for kind, server in (("vllm", url), ("sglang", sglang.url)):
            gw = _gateway(server, tmp_path, f"{kind}-{incremental}", engine, kind)
            try:
                for stream in (False, True):
                    got[kind, stream] = _two_turns(gw, stream)
            finally:
                gw.server.stop()
    assert stand_in.requests and all("input_ids" in r for r in stand_in.requests)
    assert any(r["stream"] for r in stand_in.requests)
    for stream in (False, True):
        mine, theirs = got["sglang", stream], got["vllm", stream]
        assert [(list(r.prompt_ids), r.response_ids) for r in mine] == [
            (list(r.prompt_ids), r.response_ids) for r in theirs
        ]
        for a, b in zip(mine, theirs, strict=True):
            assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-5)
        assert [r.flags for r in mine] == [("render:gateway", "chain:first"), ("render:gateway",)]
        assert all(r.trainable for r in mine)
        assert len(build(mine, strategy="prefix_merging").traces) == 1


def test_ids_sglang_contradicts_are_flagged_untrainable(tiny: tuple[Engine, str], tmp_path: Path) -> None:
    engine, url = tiny
    stand_in = SGLangStandIn(url)
    with serve(stand_in.app()) as sglang:
        gw = _gateway(sglang.url, tmp_path, "flip", engine, "sglang")
        try:
            stand_in.flip_last_id = True  # after the start-up check, which would refuse such a server
            for stream in (False, True):
                (rec,) = _two_turns_first(gw, stream)
                assert not rec.trainable and rec.response_ids is None
        finally:
            gw.server.stop()


def test_an_aborted_generation_fails_the_call_and_is_recorded(
    tiny: tuple[Engine, str], tmp_path: Path
) -> None:
    engine, url = tiny
    stand_in = SGLangStandIn(url)
    with serve(stand_in.app()) as sglang:
        gw = _gateway(sglang.url, tmp_path, "abort", engine, "sglang")
        try:
            stand_in.abort = True
            sid = gw.new_session()
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(model="m", messages=CONVERSATION, max_tokens=4)
            assert err.value.status_code == 502 and "aborted" in str(err.value)
            (failure,) = failures(gw, sid)
            assert "aborted" in json.dumps(failure)
        finally:
            gw.server.stop()


def _two_turns_first(gw: Gateway, stream: bool) -> list[Any]:
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    if stream:
        list(client.chat.completions.create(model="m", messages=CONVERSATION, max_tokens=4, stream=True))
    else:
        client.chat.completions.create(model="m", messages=CONVERSATION, max_tokens=4)
    return gw.completions(sid)
