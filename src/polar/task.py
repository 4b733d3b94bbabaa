"""The task model: what a trainer submits. Validated at submit time, so a bad task fails before it runs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from polar.runtime.base import RuntimeBackend


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class UploadAction(_Model):
    """Copy a host file or directory into the runtime before the agent starts."""

    type: Literal["upload"] = Field("upload", description="Names the action.")
    src: str = Field(description="Host file or directory (relative to the task file or config).")
    dst: str = Field(".", description="Where in the runtime, relative to its workdir (or absolute inside).")


class ExecAction(_Model):
    """Run a command in the runtime before the agent starts; retried on a non-zero exit."""

    type: Literal["exec"] = Field("exec", description="Names the action.")
    cmd: str = Field(description="Shell command, run in the runtime's workdir.")
    retries: int = Field(0, ge=0, le=10, description="Extra attempts after a non-zero exit.")
    timeout_seconds: float = Field(
        300.0, gt=0, description="Per attempt, and never past the session deadline."
    )


PrepareAction = Annotated[UploadAction | ExecAction, Field(discriminator="type")]


class ImageBuild(_Model):
    """How `runtime.image` is built where no registry holds it: `polar images build` builds it from this
    context with the engine's own builder (never a node acting on a submitted task)."""

    context: str = Field(
        min_length=1, description="Build context directory (relative to the task file, or absolute)."
    )
    dockerfile: str = Field("Dockerfile", min_length=1, description="The Dockerfile, relative to `context`.")


class RuntimeConfig(_Model):
    """Where a session's harness runs: a fresh runtime per session, prepared before the agent starts."""

    backend: RuntimeBackend | None = Field(
        None,
        description="null: the node's strongest sandbox (bwrap; an error where it cannot run). bwrap: the "
        "agent as an unprivileged user seeing the system read-only and its session directory; docker, "
        "podman, apptainer: a container of `image`; local: the host's files as the node's user, for "
        "policies you trust (docs/security.md).",
    )
    image: str | None = Field(None, description="Container image; required by docker, podman and apptainer.")
    build: ImageBuild | None = Field(
        None, description="How `polar images build` makes `image` locally (a Dockerfile and its context)."
    )
    workdir: str = Field(
        "workspace",
        description="The harness's working directory: relative to the session directory (local, bwrap) or "
        "absolute in a container.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables of the runtime.")
    read_only_paths: list[str] = Field(
        default_factory=list,
        description="Host paths the agent may read (a toolchain, a dataset), mounted read-only at the same "
        "path (bwrap, docker, podman, apptainer). Absolute; never the node's own state.",
    )
    network: Literal["gateway", "host", "none"] = Field(
        "gateway",
        description="gateway: only the gateway is reachable; host: the host's network; none: nothing. "
        "Enforced by bwrap, docker and podman (and local where namespaces work); apptainer: host or none.",
    )

    @field_validator("read_only_paths")
    @classmethod
    def _absolute(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"{path!r} must be an absolute path without '..'")
        return paths

    cpus: float | None = Field(None, gt=0, description="CPUs the container may use (docker, podman).")
    memory_mb: int | None = Field(None, gt=0, description="Memory limit in MiB (docker, podman).")
    pids_limit: int | None = Field(None, gt=0, description="Most processes at once (docker, podman).")
    prepare: list[PrepareAction] = Field(
        default_factory=list,
        description="upload and exec actions run in order before the agent starts (a failure ends the "
        "session as ERROR).",
    )


class SideCallBackend(_Model):
    """Where `side_calls: route` sends a harness's side calls: a frozen model on another server. Its
    answers are recorded but never trained on (the gateway flags them `not_trainable`)."""

    url: str = Field(
        min_length=1, description='vllm, sglang: the server root; openai: the base URL (".../v1").'
    )
    kind: Literal["openai", "vllm", "sglang"] = Field("openai", description="The server's API flavour.")
    model: str = Field(min_length=1, description="The model name that server serves.")


class AgentConfig(_Model):
    """The harness that runs the session, pointed at the gateway (docs/harnesses.md)."""

    harness: str = Field(
        "builtin",
        description='A preset (builtin, shell, or a CLI preset: docs/harnesses.md) or "package.module:Class".',
    )
    model: str | None = Field(
        None, description="The model name the harness asks for; null: the name the policy server serves."
    )
    settings: dict[str, Any] = Field(default_factory=dict, description="The preset's own settings.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment of the harness process.")
    budget_seconds: float | None = Field(
        None,
        gt=0,
        description="The agent's own time budget, counted from RUN. Running out is a trainable TIMEOUT "
        "with reward 0 (the session deadline, by contrast, masks the session).",
    )
    side_calls: Literal["train", "exclude", "route"] = Field(
        "train",
        description="Calls the preset tags as side calls (titles, a small model): train on them like any "
        "call, exclude them from the loss (recorded, masked), or route them at request time to "
        "`side_call_backend` so the policy never serves them.",
    )
    side_call_backend: SideCallBackend | None = Field(
        None,
        validate_default=True,
        description="{url, kind, model} of the frozen model that routed side calls go to; required with "
        "side_calls: route.",
    )

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
    """What scores a finished session. Rewards are fail-closed: the node, not the evaluator, masks errors."""

    strategy: str = Field(
        "session_completed",
        description='session_completed, command, test_on_output, or "package.module:Class".',
    )
    config: dict[str, Any] = Field(default_factory=dict, description="The evaluator's own settings.")
    fresh_runtime: bool | None = Field(
        None,
        description="Evaluate in a clean runtime prepared from the task while the agent runs; null: as "
        "the evaluator asks.",
    )
    timeout_seconds: float = Field(
        600.0, gt=0, description="Limit of the evaluation; past it the session is an ERROR (masked)."
    )


class Task(_Model):
    """One instruction run `num_samples` times, each sample a session: a fresh runtime, the harness, the
    gateway capturing its calls, a trajectory and a reward. The samples of a task form a GRPO group."""

    task_id: str = Field(
        min_length=1, max_length=200, description="Unique on the rollout server (for good, across runs)."
    )
    instruction: str = Field(description="What the agent is asked to do (the harness's prompt).")
    num_samples: int = Field(1, ge=1, le=4096, description="Sessions to run: the size of the task's group.")
    timeout_seconds: float = Field(
        1800.0,
        gt=0,
        description="One deadline per session, counted from INIT; exceeding it is a masked TIMEOUT.",
    )
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="See runtime.")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="See agent.")
    builder: str = Field(
        "prefix_merging",
        description='How records become traces: prefix_merging, per_request, or "package.module:function".',
    )
    builder_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of the builder: on_drift (split | merge), eot_id, train_without_logprobs, "
        "dead_branches (train | mask | drop: answers a harness retried and never used).",
    )
    evaluator: EvaluatorConfig = Field(default_factory=EvaluatorConfig, description="See evaluator.")
    callback_url: str | None = Field(
        None,
        description="http(s) URL the rollout server POSTs each result and the task-done event to (retried).",
    )
    priority: int = Field(0, description="Higher runs first; FIFO within a priority.")
    early_stop_min_usable: int | None = Field(
        None,
        ge=1,
        description="Once this many sessions COMPLETED, cancel the task's other sessions.",
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="Anything (group_id, policy_version, rollout step, ...): copied into every session's "
        "result and trajectory metadata; group_id names the GRPO group (default: the task id).",
    )
