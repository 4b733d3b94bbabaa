"""The `aider` preset: Aider (PyPI `aider-chat`), headless (`--message-file`), through LiteLLM's OpenAI Chat
client at the gateway.

    agent: {harness: aider, settings: {edit_format: diff, git: true}}

Aider has no tool calls: the model edits files by writing edit blocks in its answer (the `edit_format`:
`whole`, `diff`, `udiff`, ...), Aider applies them and, when an edit does not apply or the linter finds
errors, sends the error back as the next user message ("reflection", up to 3 times). That is its loop.

Settings: `edit_format` (Aider's own choice for the model when not given: `whole` for an unknown name),
`git` (default false: Aider runs without git, so it creates no repository in the workdir, commits nothing
and has no repo map; true: it uses the workdir's repository), `auto_commits` (default false; needs `git`:
each edit is committed, with a commit message written by the model: a side call), `reminder` (`none`, the
default, `sys` or `user`: where Aider repeats its system reminder, see below), `context_window` (the
served model's input tokens as Aider is told them: it sizes the chat-history summary and warns past it;
default 32768), `files` (workdir paths added to the chat at start), `config` (more keys of
`.aider.conf.yml`, merged over the preset's).

Everything is in Aider's own files under the session's home, written by `setup`: `.aider.conf.yml` (read
with `--config`, so a `.aider.conf.yml` in the task's repository does not override the gateway),
`.aider.model.settings.yml` and `.aider.model.metadata.json`. Facts this preset relies on, read in
aider-chat 0.86.2's source (`aider/main.py`, `args.py`, `analytics.py`, `versioncheck.py`, `models.py`,
`coders/base_coder.py`, `io.py`):
- The model is `openai/<M>` (LiteLLM's OpenAI client) with `openai-api-base: <gw>/v1` (main.py exports it
  as OPENAI_API_BASE) and `openai-api-key`; `weak-model` and `editor-model` are the same, so commit messages
  and chat summaries go to the gateway too.
- Analytics: `analytics: false` skips `Analytics.enable()` (no PostHog client is made) and the opt-in
  question; `analytics-disable: true` also records the permanent opt-out in `~/.aider/analytics.json`.
- Version checks: `check-update: false` skips `check_version` (a GET of pypi.org/pypi/aider-chat/json);
  `show-release-notes: false` skips the release-notes offer on a first run.
- Model data: without metadata for the model, `ModelInfoManager` downloads LiteLLM's price list from
  raw.githubusercontent.com; `.aider.model.metadata.json` (`model-metadata-file`) gives it locally, and
  LITELLM_LOCAL_MODEL_COST_MAP keeps LiteLLM itself from fetching it at import.
  `show-model-warnings: false` skips the model sanity check.
- Git: `git: false` (unless settings.git): with git on and no repository, `setup_git` asks to create one
  and `yes-always` would say yes; `gitignore: false` never edits .gitignore; `auto-commits: false` and
  `dirty-commits: false` commit nothing unless settings.auto_commits.
- Non-interactive: `yes-always: true` answers every question yes, except those asked with
  `explicit_yes_required` (running a suggested shell command: `io.confirm_ask` answers "n"), so
  `suggest-shell-commands: false` keeps the prompt from offering them; `pretty`, `fancy-input` and
  `stream` off or on as a pipe needs (`stream: true`: the gateway streams), `detect-urls: false` (an URL in
  the instruction would be scraped, with Playwright if installed), no browser (`gui` stays false),
  `notifications` off. Chat, input and LLM histories go to the artifacts, not the workdir.
- The loop's prompts: system, examples, the chat files' contents, then the conversation; Aider appends its
  system reminder after the last user message (`reminder: sys`) or inside it (`user`, the default for an
  unknown model). Either way a later prompt does not extend the earlier one, and each call would start a
  trace of its own; the preset sets the model's `reminder` to none (the reminder stays in the system
  prompt, where Aider always puts it). After an edit is applied the conversation moves before the chat
  files, whose contents have changed: the call after an applied edit (a lint error's reflection) cannot
  extend the one before and starts a new trace (read in `format_chat_chunks` and `move_back_cur_messages`;
  the tests exercise a reflection before any edit is applied, which stays one trace).
- Aider keeps each answer stripped of leading and trailing whitespace in its history
  (`reasoning_tags.remove_reasoning_content`), so an answer sampled with a newline at its end is not what
  the next prompt shows: that call starts a new trace too (measured with the fake policy).
- Side calls: commit messages (`prompts.commit_system`) and chat-history summaries (`prompts.summarize`),
  both through the weak model, tagged here by their system prompt.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.cli_common import (
    collect,
    deep_merge,
    one_of,
    pip_cli_env,
    positive_int,
    refuse_unknown,
    texts,
    under,
    write_file,
    write_json,
)
from polar.harness.install import pip_prefix
from polar.harness.shell import instruction_path, write_instruction
from polar.jsontypes import JSON
from polar.runtime.base import Runtime
from polar.store.records import CompletionRecord

PACKAGE = "aider-chat"
VERSION = "0.86.2"
BINARY = "aider"  # run as `python -m aider`, the module behind the `aider` script
DIALECT = "chat"
CONFIGURES = (
    "~/.aider.conf.yml (--config): model, weak and editor model openai/<M> at <gw>/v1 with the session key; "
    "analytics off and disabled, no update check or release notes, no git, commits or .gitignore edits "
    "unless settings.git/auto_commits, yes-always, no shell-command suggestions, URL detection or "
    "notifications, histories in the artifacts; .aider.model.settings.yml (no trailing reminder) and "
    ".aider.model.metadata.json (no price-list download); --message-file with the instruction"
)
LIMITS = (
    "no tool calls: edits are blocks in the answer, errors come back as user messages; the call after an "
    "applied edit re-sends the edited files before the conversation, and answers are kept stripped of "
    "surrounding whitespace: either starts a new trace; an instruction starting with `/` is an Aider "
    "command; suggested shell commands are never run (`yes-always` declines them; suggestions off)"
)

EXTENSIONS = Extensions(missing="Aider 0.86.2 has no MCP client and reads no skills")

CONF = ".aider.conf.yml"
MODEL_SETTINGS = ".aider.model.settings.yml"
MODEL_METADATA = ".aider.model.metadata.json"
REMINDERS = ("none", "sys", "user")
_SETTINGS = ("edit_format", "git", "auto_commits", "reminder", "context_window", "files", "config")
# The system prompts of Aider 0.86.2's side calls (aider/prompts.py), by their first words.
SIDE_PROMPTS = {
    "You are an expert software engineer that generates concise, one-line Git commit messages": "commit",
    "*Briefly* summarize this partial conversation about programming.": "summary",
}
HISTORIES = {
    "chat-history-file": "aider.chat.history.md",
    "input-history-file": "aider.input.history",
    "llm-history-file": "aider.llm.history",
}


def _flag(name: str, value: JSON) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"aider harness: settings.{name} must be true or false, not {value!r}")
    return value


class AiderHarness:
    name = "aider"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        refuse_unknown(self.name, settings, _SETTINGS)
        fmt = settings.get("edit_format")
        if fmt is not None and (not isinstance(fmt, str) or not fmt):
            raise ValueError(f"aider harness: settings.edit_format must be an edit format name, not {fmt!r}")
        self.edit_format: str | None = fmt
        self.git = _flag("git", settings.get("git", False))
        self.auto_commits = _flag("auto_commits", settings.get("auto_commits", False))
        if self.auto_commits and not self.git:
            raise ValueError(
                "aider harness: settings.auto_commits needs settings.git (commits need a repository)"
            )
        self.reminder: str = one_of(self.name, "reminder", settings.get("reminder", "none"), REMINDERS)
        self.context_window = positive_int(self.name, "context_window", settings.get("context_window", 32768))
        files = settings.get("files", [])
        if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
            raise ValueError(f"aider harness: settings.files must be a list of paths, not {files!r}")
        self.files: list[str] = files
        config = settings.get("config", {})
        if not isinstance(config, dict):
            raise ValueError(f"aider harness: settings.config must be a mapping, not {config!r}")
        clash = sorted({"openai-api-base", "openai-api-key", "model", "config"} & set(config))
        if clash:
            raise ValueError(f"aider harness: settings.config may not set {clash} (the gateway's)")
        self.extra: dict[str, Any] = config
        self.prefix: Path | None = None

    def model(self, ctx: HarnessContext) -> str:
        return f"openai/{ctx.model}"  # LiteLLM's OpenAI-compatible Chat client

    def config(self, ctx: HarnessContext) -> dict[str, Any]:
        """The `.aider.conf.yml` the preset writes (keys are Aider's long option names)."""
        model = self.model(ctx)
        base: dict[str, Any] = {
            "model": model,
            "weak-model": model,
            "editor-model": model,
            "openai-api-base": f"{ctx.gateway_url.rstrip('/')}/v1",
            "openai-api-key": ctx.session_id,
            "model-settings-file": under(ctx.home, MODEL_SETTINGS),
            "model-metadata-file": under(ctx.home, MODEL_METADATA),
            "message-file": instruction_path(ctx),
            "analytics": False,
            "analytics-disable": True,
            "check-update": False,
            "show-release-notes": False,
            "show-model-warnings": False,
            "git": self.git,
            "gitignore": False,
            "auto-commits": self.auto_commits,
            "dirty-commits": self.auto_commits,
            "yes-always": True,
            "suggest-shell-commands": False,
            "detect-urls": False,
            "pretty": False,
            "fancy-input": False,
            "stream": True,
            "notifications": False,
            "restore-chat-history": False,
            "encoding": "utf-8",
            **{key: under(ctx.artifacts, name) for key, name in HISTORIES.items()},
        }
        if self.edit_format is not None:
            base["edit-format"] = self.edit_format
        if self.files:
            base["file"] = list(self.files)
        return deep_merge(base, self.extra)

    def model_settings(self, ctx: HarnessContext) -> list[dict[str, Any]]:
        """Aider's model settings for the served model (an exact entry: no guessing from its name)."""
        entry: dict[str, Any] = {
            "name": self.model(ctx),
            "weak_model_name": self.model(ctx),
            "editor_model_name": self.model(ctx),
            "reminder": None if self.reminder == "none" else self.reminder,
            "use_repo_map": self.git,
        }
        if self.edit_format is not None:
            entry["edit_format"] = self.edit_format
        return [entry]

    def model_metadata(self, ctx: HarnessContext) -> dict[str, Any]:
        return {
            self.model(ctx): {
                "max_input_tokens": self.context_window,
                "max_tokens": self.context_window,
                "max_output_tokens": self.context_window,
                "input_cost_per_token": 0.0,
                "output_cost_per_token": 0.0,
                "litellm_provider": "openai",
                "mode": "chat",
            }
        }

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        self.prefix = await asyncio.to_thread(pip_prefix, PACKAGE, VERSION)
        await write_instruction(runtime, ctx)
        # JSON is YAML: Aider's YAML loaders read these as written.
        await write_file(runtime, under(ctx.home, CONF), json.dumps(self.config(ctx), indent=2))
        await write_file(
            runtime, under(ctx.home, MODEL_SETTINGS), json.dumps(self.model_settings(ctx), indent=2)
        )
        await write_json(runtime, under(ctx.home, MODEL_METADATA), self.model_metadata(ctx))

    def command(self, ctx: HarnessContext) -> list[str]:
        return [sys.executable, "-m", "aider", "--config", under(ctx.home, CONF)]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {**gateway_env(ctx), **pip_cli_env(self.prefix), "TERM": "dumb", **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        """Aider's own state under the home (its analytics opt-out, caches) joins its histories."""
        return await collect(runtime, ctx, "aider-home", [".aider"])

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        """Commit messages and chat summaries (by their system prompts); everything else is the loop."""
        messages = record.request.get("messages") or []
        first = messages[0] if messages and isinstance(messages[0], dict) else {}
        if first.get("role") != "system":
            return ()
        text = "".join(texts(first.get("content")))
        for opening, kind in SIDE_PROMPTS.items():
            if opening in text:
                return ("side_call", kind)
        return ()


PRESET = AiderHarness
