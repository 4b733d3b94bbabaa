"""Asking a frozen judge model for a verdict, as the `judge` evaluators do: recorded, constrained, strictly
parsed, retried, cached, and failing closed.

- Recorded: every call goes through a gateway session of its own (`EvalContext.models`), opened for this
  judgement and closed after it, so each is a record tagged `judge`, never trainable, linked to the session
  it judged (`judged_session` in that session's metadata) and replayable with `polar replay`.
- Constrained: the request asks for the verdict's JSON schema (`response_format: json_schema`, which vLLM
  0.32 turns into structured outputs, SGLang into its `json_schema`, OpenAI into strict JSON). Whatever
  the server did with it, the answer is parsed strictly: one JSON document, no duplicate keys, no NaN,
  integers that are integers, every schema rule.
- Retried: a call that fails, is cut at max_tokens or answers off-schema is asked again (`attempts` in all;
  later attempts sample at `retry_temperature` with the next seed, since a greedy repeat answers the same).
- Fail-closed: with no valid verdict after the last attempt the evaluator raises `EvaluatorError`, so the
  node masks the session (ERROR) with the reason: an evaluator failure, never a 0 the policy earned.
- Cached: identical inputs (messages, judge model, sampling, schema) are judged once per store
  (`polar.evaluate.judge_cache`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from jsonschema import Draft202012Validator, validators
from pydantic import Field, field_validator

from polar.evaluate.base import EvalContext, EvaluatorModels, ModelSession
from polar.evaluate.judge_cache import JudgeCache, content_key
from polar.evaluate.support import EvaluatorError, StrictConfig, tail

JUDGE_TAG = "judge"
CACHE_VERSION = 1  # bump when what a cached verdict means changes


class JudgeBackend(StrictConfig):
    """The frozen judge model: `url` (vllm, sglang: the server root; openai: the base URL), `kind`, `model`."""

    url: str = Field(min_length=1)
    kind: Literal["openai", "vllm", "sglang"] = "openai"
    model: str = Field(min_length=1)

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"must be an http(s) URL, not {url!r}")
        return url


class Sampling(StrictConfig):
    """The judge's sampling: greedy and seeded by default, so a judgement repeats where the server allows."""

    temperature: float = Field(0.0, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = 0
    max_tokens: int = Field(1024, ge=1, le=131072)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {enable_thinking: false} for a Qwen3 judge


class JudgeSettings(StrictConfig):
    """What every judge evaluator's config holds besides its own fields."""

    backend: JudgeBackend
    scale: int = Field(10, ge=1, le=100)  # scores are integers 0..scale; the reward is score / scale
    reasoning_chars: int = Field(1000, ge=0, le=20000)  # the verdict's `reasoning` field; 0: none asked
    sampling: Sampling = Field(default_factory=Sampling)
    retry_temperature: float = Field(0.7, ge=0, le=2)
    attempts: int = Field(3, ge=1, le=10)
    call_timeout_seconds: float = Field(300.0, gt=0)
    structured: bool = True  # send the schema as response_format (off for servers that refuse it)
    cache: bool = True


class InvalidJudgement(Exception):
    """One attempt gave no usable verdict (the call failed, was cut, or its answer breaks the schema)."""


@dataclass(frozen=True)
class Judgement:
    verdict: dict[str, Any]
    session_id: str  # the judge session whose call gave the verdict
    seq: int  # that call's seq in it
    attempts: int  # calls made for this judgement (0: from the cache)
    cached: bool
    key: str
    problems: list[str] = field(default_factory=list)  # why the earlier attempts were refused

    def details(self, model: str) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "seq": self.seq,
            "model": model,
            "attempts": self.attempts,
            "cached": self.cached,
            "cache_key": self.key,
            **({"refused_attempts": self.problems} if self.problems else {}),
        }


def _strict_integers(checker: Any, instance: Any) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)  # 3.0 is not an integer here


_Validator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", _strict_integers),
)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_verdict(content: str | None, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The judge's answer as the object `schema` describes, or `InvalidJudgement` saying what is wrong."""
    if content is None or not content.strip():
        raise InvalidJudgement("the judge answered no text")
    try:
        value = json.loads(content, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except ValueError as exc:
        raise InvalidJudgement(f"the answer is not one JSON object ({exc}): {tail(content, 200)!r}") from None
    error = next(iter(sorted(_Validator(dict(schema)).iter_errors(value), key=lambda e: list(e.path))), None)
    if error is not None:
        where = "/".join(str(p) for p in error.path) or "the answer"
        raise InvalidJudgement(f"{where}: {error.message}")
    if not isinstance(value, dict):
        raise InvalidJudgement("the answer is not a JSON object")
    return value


def verdict_schema(settings: JudgeSettings) -> dict[str, Any]:
    """One score (an integer 0..scale), after a bounded `reasoning` unless `reasoning_chars` is 0."""
    props: dict[str, Any] = {}
    if settings.reasoning_chars:
        props["reasoning"] = {"type": "string", "maxLength": settings.reasoning_chars}
    props["score"] = {"type": "integer", "minimum": 0, "maximum": settings.scale}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def request_body(
    settings: JudgeSettings, messages: list[dict[str, Any]], schema: Mapping[str, Any], attempt: int
) -> dict[str, Any]:
    """The chat request of attempt `attempt` (0-based)."""
    s = settings.sampling
    body: dict[str, Any] = {
        "model": settings.backend.model,
        "messages": messages,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature if attempt == 0 else max(s.temperature, settings.retry_temperature),
    }
    if s.top_p is not None:
        body["top_p"] = s.top_p
    if s.seed is not None:
        body["seed"] = s.seed + attempt
    if s.chat_template_kwargs:
        body["chat_template_kwargs"] = s.chat_template_kwargs
    if settings.structured:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": dict(schema), "strict": True},
        }
    return body


def cache_key(settings: JudgeSettings, messages: list[dict[str, Any]], schema: Mapping[str, Any]) -> str:
    return content_key(
        {
            "version": CACHE_VERSION,
            "model": settings.backend.model,
            "messages": messages,
            "schema": schema,
            "sampling": settings.sampling.model_dump(),
            "retry_temperature": settings.retry_temperature,
            "structured": settings.structured,
        }
    )


async def _ask(client: httpx.AsyncClient, session: ModelSession, body: dict[str, Any]) -> str | None:
    """One call through the judge's gateway session: the answer's text, or `InvalidJudgement`."""
    try:
        r = await client.post(
            f"{session.base_url}/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {session.session_id}"},
        )
    except httpx.HTTPError as exc:
        raise InvalidJudgement(f"the call failed: {type(exc).__name__}: {exc}") from None
    try:
        data = r.json()
    except ValueError:
        data = None
    if r.status_code != 200:
        message = data.get("error", {}).get("message") if isinstance(data, dict) else None
        raise InvalidJudgement(f"the gateway answered HTTP {r.status_code}: {message or tail(r.text, 200)}")
    try:
        choice = data["choices"][0]
        content, finish = choice["message"].get("content"), choice.get("finish_reason")
    except (TypeError, KeyError, IndexError):
        raise InvalidJudgement("the answer has no choices[0].message") from None
    if finish == "length":
        raise InvalidJudgement(f"the answer was cut at max_tokens: {tail(str(content), 200)!r}")
    return content if isinstance(content, str) else None


async def judge(
    settings: JudgeSettings,
    ctx: EvalContext,
    messages: list[dict[str, Any]],
    schema: Mapping[str, Any],
    metadata: Mapping[str, Any],
) -> Judgement:
    """The verdict for `messages` about the session of `ctx`; `EvaluatorError` when there is none."""
    return await ask_judge(settings, ctx.models, ctx.session_id, messages, schema, metadata)


async def ask_judge(
    settings: JudgeSettings,
    models: EvaluatorModels | None,
    judged: str,
    messages: list[dict[str, Any]],
    schema: Mapping[str, Any],
    metadata: Mapping[str, Any],
) -> Judgement:
    """The verdict for `messages` (from the cache, or asked through a judge session opened for it and linked
    to the session `judged`); `EvaluatorError` when there is none."""
    key = cache_key(settings, messages, schema)
    state = models.state_path if models is not None else None
    cache = JudgeCache(state) if settings.cache and state is not None else None
    if cache is not None:
        hit = await cache.get(key)
        if hit is not None and isinstance(hit.get("verdict"), dict):
            return Judgement(hit["verdict"], str(hit.get("session_id")), int(hit.get("seq", 0)), 0, True, key)
    if models is None:
        raise EvaluatorError("judge: no gateway to call the judge through (judges run on a node)")
    backend = settings.backend.model_dump()
    try:
        session = await models.open_session(JUDGE_TAG, backend, judged, metadata)
    except ValueError as exc:
        raise EvaluatorError(f"judge: cannot open a judge session: {exc}") from None
    problems: list[str] = []
    try:
        async with httpx.AsyncClient(timeout=settings.call_timeout_seconds) as client:
            for attempt in range(settings.attempts):
                try:
                    content = await _ask(client, session, request_body(settings, messages, schema, attempt))
                    verdict = parse_verdict(content, schema)
                except InvalidJudgement as exc:
                    problems.append(f"attempt {attempt + 1}: {exc}")
                    continue
                judgement = Judgement(verdict, session.session_id, attempt, attempt + 1, False, key, problems)
                break
            else:
                raise EvaluatorError(
                    f"judge: no valid judgement from {settings.backend.model} in {settings.attempts} "
                    f"attempt(s) (judge session {session.session_id}): {'; '.join(problems)}"
                )
    finally:
        await models.close_session(session.session_id)
    if cache is not None:
        await cache.put(key, {"verdict": verdict, "session_id": session.session_id, "seq": judgement.seq})
    return judgement
