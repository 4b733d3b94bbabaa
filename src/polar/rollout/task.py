"""The task model: what a trainer submits. Validated at submit time, so a bad task fails before it runs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class UploadAction(_Model):
    """Copy a host file or directory into the runtime before the agent starts."""

    type: Literal["upload"] = "upload"
    src: str
    dst: str = "."


class ExecAction(_Model):
    """Run a command in the runtime before the agent starts; retried on a non-zero exit."""

    type: Literal["exec"] = "exec"
    cmd: str
    retries: int = Field(0, ge=0, le=10)
    timeout_seconds: float = Field(300.0, gt=0)


PrepareAction = Annotated[UploadAction | ExecAction, Field(discriminator="type")]


class RuntimeConfig(_Model):
    backend: Literal["local", "bwrap", "docker", "apptainer"] = "local"
    image: str | None = None
    workdir: str = "workspace"
    env: dict[str, str] = Field(default_factory=dict)
    network: Literal["gateway", "host", "none"] = "gateway"
    prepare: list[PrepareAction] = Field(default_factory=list)


class SideCallBackend(_Model):
    """Where `side_calls: route` sends a harness's side calls: a frozen model on another server. Its
    answers are recorded but never trained on (the gateway flags them `not_trainable`)."""

    url: str = Field(min_length=1)  # vllm/sglang: the server root; openai: the base URL (".../v1")
    kind: Literal["openai", "vllm", "sglang"] = "openai"
    model: str = Field(min_length=1)  # the model name that server serves


class AgentConfig(_Model):
    harness: str = "builtin"  # a preset name or "package.module:Class"
    model: str | None = None  # the name the harness asks for (default: the served model)
    settings: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    budget_seconds: float | None = Field(None, gt=0)  # the agent's own time budget, counted from RUN
    # What to do with calls the harness's `classify` tags "side_call" (titles, a small model): train on them
    # like any call, keep them out of the loss (recorded and listed, masked), or send them at request time
    # to `side_call_backend` (a frozen model) so the policy never serves them.
    side_calls: Literal["train", "exclude", "route"] = "train"
    side_call_backend: SideCallBackend | None = Field(None, validate_default=True)

    @field_validator("side_call_backend")
    @classmethod
    def _route_needs_backend(
        cls, value: SideCallBackend | None, info: ValidationInfo
    ) -> SideCallBackend | None:
        # A field validator (not a model one) so the error is located at agent.side_call_backend.
        if value is None and info.data.get("side_calls") == "route":
            raise ValueError(
                "required when agent.side_calls is 'route': {url, kind, model} of the frozen model"
            )
        return value


class EvaluatorConfig(_Model):
    strategy: str = "session_completed"  # a registered name or "package.module:Class"
    config: dict[str, Any] = Field(default_factory=dict)
    fresh_runtime: bool | None = None  # None: as the evaluator asks
    timeout_seconds: float = Field(600.0, gt=0)


class Task(_Model):
    task_id: str = Field(min_length=1, max_length=200)
    instruction: str
    num_samples: int = Field(1, ge=1, le=4096)
    timeout_seconds: float = Field(1800.0, gt=0)  # one deadline per session, counted from INIT
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    builder: str = "prefix_merging"
    builder_options: dict[str, Any] = Field(default_factory=dict)
    evaluator: EvaluatorConfig = Field(default_factory=EvaluatorConfig)
    callback_url: str | None = None
    priority: int = 0
    early_stop_min_usable: int | None = Field(None, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)  # group id, policy version, rollout step, ...
