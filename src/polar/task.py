"""The task model: what a trainer submits. Validated at submit time, so a bad task fails before it runs."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from polar.runtime.base import RuntimeBackend
from polar.runtime.inventory import image_name_problem


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
    image: str | None = Field(
        None,
        max_length=1000,
        description="Container image (no whitespace, not starting with '-'); required by docker, podman and "
        "apptainer.",
    )
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

    @field_validator("image")
    @classmethod
    def _an_image_not_an_option(cls, v: str | None) -> str | None:
        problem = None if v is None else image_name_problem(v)  # `--privileged` is an option, not an image
        if problem is not None:
            raise ValueError(problem)
        return v

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


# An MCP server's name is part of each of its tools' names, where underscores separate the parts (Codex and
# Claude Code `mcp__<server>__<tool>`, Gemini CLI `mcp_<server>_<tool>`, OpenCode `<server>_<tool>`) and
# providers cap the whole at 64 characters: so a letter, then letters, digits and hyphens, at most 32 in all.
MCP_SERVER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,31}")
# The Agent Skills rule Pi 0.73.1 checks (and the folder name every CLI reads the skill from).
SKILL_NAME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
SKILL_FILE = "SKILL.md"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FRONT_MATTER = re.compile(r"---\r?\n(.*?)\r?\n---(?:\r?\n|$)", re.DOTALL)


class McpServer(_Model):
    """A stdio MCP server. The harness starts it inside the session's runtime, so it sees only the files the
    sandbox sees and reaches only what the sandbox reaches."""

    command: str = Field(
        min_length=1,
        description="The program: absolute, or found on the runtime's PATH (looked up before the harness "
        "starts: a session whose runtime lacks it ends in error at setup, naming the server).",
    )
    args: list[str] = Field(default_factory=list, description="Its arguments.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Variables set for it, over the environment its harness passes (some pass a filtered "
        "one: docs/harnesses.md).",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in env if not ENV_NAME.fullmatch(k))
        if bad:
            raise ValueError(f"{bad[0]!r} is not an environment variable name")
        return env


class Skill(_Model):
    """An Agent Skill: a folder holding SKILL.md (YAML front matter with the skill's `name` and a
    `description` the CLI shows the model, then its instructions) and any files it refers to. The preset
    writes it where its CLI reads skills."""

    name: str = Field(
        description="Lowercase letters and digits, single hyphens between them, at most 64 characters (the "
        "Agent Skills rule); the skill's folder name."
    )
    content: str = Field(
        description="SKILL.md's text: front matter between `---` lines with `name` (this name) and "
        "`description` (at most 1024 characters), then the instructions. A task file may give `path` "
        "instead: a SKILL.md, or a folder holding one (its other files become `files`), relative to the "
        "task file and inside its folder."
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="The skill's other files as text, by path relative to its folder (scripts/run.sh).",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if len(name) > 64 or not SKILL_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r}: a skill name is lowercase letters and digits with single hyphens between them, "
                "at most 64 characters"
            )
        return name

    @field_validator("content")
    @classmethod
    def _front_matter(cls, content: str, info: ValidationInfo) -> str:
        # Each CLI drops a SKILL.md it cannot read without a word; Gemini CLI needs both keys.
        match = _FRONT_MATTER.match(content)
        if match is None:
            raise ValueError(
                "SKILL.md must start with front matter: a `---` line, `name:` and `description:`, `---`"
            )
        try:
            meta = yaml.safe_load(match.group(1))
        except yaml.YAMLError as exc:
            raise ValueError(f"SKILL.md's front matter is not YAML: {exc}") from None
        if not isinstance(meta, dict):
            raise ValueError("SKILL.md's front matter must be a mapping with `name` and `description`")
        name, description = meta.get("name"), meta.get("description")
        if "name" in info.data and name != info.data["name"]:
            raise ValueError(
                f"SKILL.md's front matter names {name!r}; it must name the skill, {info.data['name']!r}"
            )
        if not isinstance(description, str) or not description.strip() or len(description) > 1024:
            raise ValueError("SKILL.md's front matter needs a `description` of 1 to 1024 characters")
        return content

    @field_validator("files")
    @classmethod
    def _relative_paths(cls, files: dict[str, str]) -> dict[str, str]:
        for path in files:
            parts = path.split("/")
            if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path:
                raise ValueError(f"{path!r}: a file of the skill is a relative path inside its folder")
            if path == SKILL_FILE:
                raise ValueError(f"{SKILL_FILE} is the skill's `content`, not one of its `files`")
        return files


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
    mcp_servers: dict[str, McpServer] = Field(
        default_factory=dict,
        description="stdio MCP servers by name (a letter, then letters, digits and hyphens, at most 32), "
        "started by the harness inside the sandbox. Each preset whose CLI has an MCP client writes them into "
        "its own configuration; any other harness refuses the field (docs/harnesses.md: MCP servers and "
        "skills).",
    )
    skills: list[Skill] = Field(
        default_factory=list,
        description="Agent Skills, written where the harness's CLI reads them; refused by a harness whose "
        "CLI reads none.",
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

    @field_validator("mcp_servers")
    @classmethod
    def _server_names(cls, servers: dict[str, McpServer]) -> dict[str, McpServer]:
        for name in servers:
            if not MCP_SERVER_NAME.fullmatch(name):
                raise ValueError(
                    f"{name!r}: a server name is a letter, then letters, digits and hyphens, at most 32 "
                    "characters (it becomes part of each tool's name, whose parts underscores separate)"
                )
        return servers

    @field_validator("skills")
    @classmethod
    def _unique_skills(cls, skills: list[Skill]) -> list[Skill]:
        names = [s.name for s in skills]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"skill {twice[0]!r} is given twice")
        return skills


class EvaluatorConfig(_Model):
    """What scores a finished session. Rewards are fail-closed: the node, not the evaluator, masks errors."""

    strategy: str = Field(
        "session_completed",
        description="session_completed, command, test_on_output, swebench, harbor, judge, judge_group "
        "(docs/rewards.md), "
        'or "package.module:Class".',
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


EVALUATOR_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


class NamedEvaluator(EvaluatorConfig):
    """One of several evaluators whose rewards make one (`reward`): the fields of `evaluator`, each with its
    own timeout (the evaluation as a whole gets their sum)."""


class RewardConfig(_Model):
    """How the rewards of `evaluators` make the session's one: each evaluator's reward is thresholded
    (`thresholds`), then weighted (`weights`), then combined. Names in both maps are checked against
    `evaluators` when the task is checked (at load, submit and admission)."""

    combine: Literal["sum", "min", "product"] = Field(
        "sum",
        description="sum: the weighted rewards added up; min: the lowest (every evaluator must pay: tests "
        "pass AND the judge approves); product: the weighted rewards multiplied.",
    )
    weights: dict[str, float] = Field(
        default_factory=dict,
        description="By evaluator name (default 1): each reward is multiplied by its weight before it is "
        "combined. Finite and at least 0.",
    )
    thresholds: dict[str, float] = Field(
        default_factory=dict,
        description="By evaluator name: its reward counts as 1 at or above the threshold and 0 below it (a "
        "judge's score of at least 0.5 as a pass).",
    )

    @field_validator("weights", "thresholds")
    @classmethod
    def _finite(cls, values: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        for name, value in values.items():
            if not math.isfinite(value) or (info.field_name == "weights" and value < 0):
                what = "a finite number of at least 0" if info.field_name == "weights" else "a finite number"
                raise ValueError(f"{name}: {value!r} is not {what}")
        return values


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
    evaluators: dict[str, NamedEvaluator] = Field(
        default_factory=dict,
        description="Instead of `evaluator`: several, by name (a lower-case letter, then lower-case letters, "
        "digits and _, at most 32), run in this order, their rewards combined as `reward` says; each "
        "entry has the fields of `evaluator` (docs/rewards.md).",
    )
    reward: RewardConfig | None = Field(
        None, description="How the rewards of `evaluators` make one (default: their sum). See reward."
    )
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

    @field_validator("evaluators")
    @classmethod
    def _evaluator_names(cls, evaluators: dict[str, NamedEvaluator]) -> dict[str, NamedEvaluator]:
        for name in evaluators:
            if not EVALUATOR_NAME.fullmatch(name):
                raise ValueError(
                    f"{name!r}: an evaluator's name is a lower-case letter, then lower-case letters, digits "
                    "and _ (at most 32)"
                )
        return evaluators

    def evaluation_timeout(self) -> float:
        """How long the whole evaluation may take: `evaluator.timeout_seconds`, or the sum of the
        `evaluators`' (each also has its own)."""
        if self.evaluators:
            return sum(e.timeout_seconds for e in self.evaluators.values())
        return self.evaluator.timeout_seconds

    @field_validator("metadata")
    @classmethod
    def _no_evaluator_route(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        # The gateway routes every call of a session carrying it to a frozen model (a judge's own session,
        # polar.gateway.routing): a policy session must never carry it.
        if "evaluator_route" in metadata:
            raise ValueError(
                "evaluator_route is set by the node for an evaluator's own session, never by a task"
            )
        return metadata
