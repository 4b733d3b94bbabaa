"""The `codex` preset runs the real Codex CLI (npm @openai/codex, pinned) on a node, in the local runtime and
in bubblewrap with no network but the gateway, against the scripted fake policy behind a real gateway."""

from __future__ import annotations

import asyncio
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar.harness import HarnessContext, cli_common, get_harness
from polar.harness.presets import codex
from polar.rollout.protocol import SessionStatus
from polar.runtime import RuntimeSpec, make_runtime
from polar.runtime.base import Runtime, RuntimeFailure
from polar.store.records import CompletionRecord
from polar.trajectory import Trajectory, audit
from tests import extension_support as ext
from tests import mcp_weather
from tests.fakes.fake_vllm import Reply
from tests.preset_run_support import (
    check_run,
    jsonl_lines,
    needs_bwrap,
    needs_npm,
    needs_strace,
    run_cli,
    run_preset,
    streamed,
    tool_script,
    traced_against_gateway,
)

# Codex 0.171.0's shell tool is `exec_command` with a `cmd` string (it runs it with `bash -lc`).
TOOL = "exec_command"
ARGS = '{"cmd":"printf \'hello from codex\\\\n\' > hello.txt"}'
EXPECT = "'hello from codex\\n'"


def ctx(tmp_path: Path, **kw: object) -> HarnessContext:
    fields: dict[str, object] = {
        "session_id": "sess-x",
        "gateway_url": "http://127.0.0.1:9999/",
        "model": "served-model",
        "instruction": "-do it",
        "home": str(tmp_path / "home"),
        "workdir": str(tmp_path / "work"),
        "artifacts": str(tmp_path / "art"),
    }
    return HarnessContext(**{**fields, **kw})  # type: ignore[arg-type]


@pytest.mark.cli
@needs_npm
@pytest.mark.parametrize(
    "backend",
    ["local", pytest.param("bwrap", marks=needs_bwrap), pytest.param("docker", marks=pytest.mark.containers)],
)
async def test_codex_writes_the_file_through_the_gateway(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """docker: the pinned static binary from the node's tool cache (mounted read-only) in polar's base image,
    which has no node, in a container whose only network is the gateway on its 127.0.0.1."""
    image = None
    if backend == "docker":
        from tests.container_support import base_image

        image = base_image(str(request.getfixturevalue("docker_engine")))
    run = await run_cli(tmp_path, "codex", TOOL, ARGS, EXPECT, backend=backend, image=image)
    check_run(run, dialect="responses", tool=TOOL, paths={"/v1/responses"})
    assert all(streamed(r, run.seen) for r in run.records)
    assert all(s.headers.get("authorization") == "Bearer sess-cli" for s in run.seen if s.method == "POST")
    first, last = run.records[0], run.records[-1]
    # The request shape Codex 0.171.0 sends: stateless Responses with encrypted reasoning asked back.
    assert first.request["store"] is False
    assert first.request["include"] == ["reasoning.encrypted_content"]
    assert first.model_requested == "fake-policy"
    assert not any(t.get("type") == "web_search" for t in first.request["tools"])  # disabled by config
    # It echoes its function_call byte for byte and sends the tool's output back.
    kinds = [i.get("type") for i in last.request["input"]]
    assert "function_call" in kinds and "function_call_output" in kinds
    call = next(i for i in last.request["input"] if i.get("type") == "function_call")
    assert call["arguments"] == ARGS
    # Its own transcript and last message are in the artifacts.
    events = jsonl_lines(run.artifacts / codex.SESSIONS_COPY)
    assert any(e.get("type") == "response_item" for e in events)
    assert "Done" in (run.artifacts / codex.LAST_MESSAGE).read_text()
    assert run.result.metadata["harness"]["transcripts"] >= 1


@pytest.mark.cli
@needs_npm
async def test_codex_runs_its_static_binary_as_its_launcher_would(tmp_path: Path) -> None:
    """0.171.0's npm launcher (a node script) execve()s the platform package's static binary with two
    variables; the preset runs that binary with those variables, so an image needs no node."""
    from polar.harness.install import npm_prefix

    prefix = npm_prefix(codex.PACKAGE, codex.VERSION)
    native = codex.native_binary(prefix)
    assert native is not None and native.name == "codex" and "musl" in str(native)
    launcher = (prefix / "node_modules/@openai/codex/bin/codex.js").read_text()
    assert "process.execve(binaryPath" in launcher and "CODEX_MANAGED_PACKAGE_ROOT" in launcher
    harness = get_harness("codex")
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path / "rt"), "sess-x")
    await runtime.start()
    try:
        c = ctx(tmp_path)
        await harness.setup(runtime, c)
        assert harness.command(c).startswith(str(native) + " exec ")
        env = harness.env(c)
        assert env["CODEX_MANAGED_BY_NPM"] == "1"
        assert env["CODEX_MANAGED_PACKAGE_ROOT"] == str((prefix / "node_modules/@openai/codex").resolve())
    finally:
        await runtime.stop()


@pytest.mark.cli
@needs_npm
async def test_reasoning_round_trips_as_encrypted_content(tmp_path: Path) -> None:
    """Codex 0.171.0 keeps reasoning as an opaque `encrypted_content` it sends back next turn; the gateway
    decodes it, so the policy sees its own reasoning again."""
    settings = {"reasoning_effort": "high"}
    run = await run_cli(tmp_path, "codex", TOOL, ARGS, EXPECT, settings=settings, reasoning="Plan: printf.")
    check_run(run, dialect="responses", tool=TOOL, paths={"/v1/responses"})
    assert run.records[0].request["reasoning"] == {"effort": "high", "summary": "auto"}
    assert run.records[0].upstream_request["reasoning_effort"] == "high"
    (item,) = [i for i in run.records[1].request["input"] if i.get("type") == "reasoning"]
    assert item["encrypted_content"] and item["summary"] == [
        {"type": "summary_text", "text": "Plan: printf."}
    ]
    (assistant,) = [m for m in run.records[1].upstream_request["messages"] if m["role"] == "assistant"]
    assert assistant["reasoning_content"] == "Plan: printf."


@pytest.mark.cli
@needs_npm
async def test_a_failing_policy_server_ends_the_session_as_error(tmp_path: Path) -> None:
    """Codex sees the gateway's `response.failed` event and exits non-zero: the node ends the session ERROR
    (masked), never as a zero-reward sample."""
    run = await run_cli(
        tmp_path, "codex", TOOL, ARGS, EXPECT, settings={"max_retries": 0}, backend_status=503
    )
    assert run.records == [] and len(run.seen) == 1  # no retry: max_retries reached the provider
    assert run.result.status == SessionStatus.ERROR, (run.result.status, run.result.reason)
    assert "inference backend failed" in (run.result.reason or "")


SUBTASK = "SUBTASK: write sub.txt."
SPAWN = "multi_agent_v1__spawn_agent"  # Codex's `spawn_agent` in its `multi_agent_v1` namespace, flattened
WAIT = "multi_agent_v1__wait_agent"


def delegating_script(body: dict[str, Any]) -> Reply:
    """The policy: spawn a sub-agent for SUBTASK, wait for it, write hello.txt itself, then answer. The
    sub-agent (the call whose user message is SUBTASK) writes sub.txt and answers."""
    messages = body["messages"]
    outputs = [m["content"] for m in messages if m["role"] == "tool"]
    if any(m["role"] == "user" and SUBTASK in str(m["content"]) for m in messages):
        if not outputs:
            return Reply("On it.", tool_calls=[(TOOL, '{"cmd":"printf sub > sub.txt"}')])
        return Reply("sub.txt is written.")
    if not outputs:
        return Reply("Delegating sub.txt.", tool_calls=[(SPAWN, json.dumps({"message": SUBTASK}))])
    if len(outputs) == 1:
        # What spawn_agent returned: Codex ran the call (a call it cannot route: "unsupported call: ...").
        agent = json.loads(outputs[0])["agent_id"]
        return Reply("Waiting for it.", tool_calls=[(WAIT, json.dumps({"targets": [agent]}))])
    if len(outputs) == 2:
        return Reply("Now hello.txt.", tool_calls=[(TOOL, '{"cmd":"printf main > hello.txt"}')])
    return Reply("Done.")


@pytest.mark.cli
@needs_npm
async def test_codex_spawns_a_sub_agent_through_the_namespaced_tool(tmp_path: Path) -> None:
    """The policy calls `multi_agent_v1__spawn_agent`; Codex 0.171.0 gets it back as `spawn_agent` in its
    namespace (as a flat name it answers "unsupported call"), runs the sub-agent, whose calls reach the
    gateway under the same session key, are recorded in the session and tagged `subagent`; the main loop
    stays one trace around them."""
    run = await run_preset(
        tmp_path, "codex", {}, delegating_script, expect="mainsub", check="cat hello.txt sub.txt"
    )
    assert run.result.status == SessionStatus.COMPLETED and run.result.reward == 1.0, run.result.reason
    posts = [s for s in run.seen if s.method == "POST"]
    assert len(run.records) == len(posts) == len(run.fake.requests) == 6
    assert {s.headers.get("authorization") for s in posts} == {"Bearer sess-cli"}
    # The sub-agent names itself in a header and in the body's client_metadata, which the record keeps.
    assert [s.headers.get("x-openai-subagent") for s in posts].count("collab_spawn") == 2
    tags = [run.preset.classify(r) for r in run.records]
    sub = [r for r, t in zip(run.records, tags, strict=True) if t == ("side_call", "subagent")]
    main = [r for r, t in zip(run.records, tags, strict=True) if not t]
    assert len(sub) == 2 and len(main) == 4
    assert all(SUBTASK in json.dumps(r.request["input"]) for r in sub)
    # The namespaced tool went up flat, came back to Codex with its namespace, and Codex echoed it so.
    assert SPAWN in [t["function"]["name"] for t in main[0].tools or []]
    assert main[0].response_message["tool_calls"][0]["function"]["name"] == SPAWN
    echoed = [i for i in main[-1].request["input"] if i.get("type") == "function_call"]
    assert [(i.get("namespace"), i["name"]) for i in echoed] == [
        ("multi_agent_v1", "spawn_agent"),
        ("multi_agent_v1", "wait_agent"),
        (None, TOOL),
    ]
    waited = [i["output"] for i in main[-2].request["input"] if i.get("type") == "function_call_output"]
    assert "sub.txt is written." in waited[-1]  # wait_agent returned the sub-agent's final answer
    # The node's trajectory: the sub-agent listed among the side calls; the main loop one trace.
    traj = Trajectory.model_validate(run.result.trajectory)
    assert set(traj.metadata["side_calls"]["completion_ids"]) == {r.completion_id for r in sub}
    main_ids = {r.completion_id for r in main}
    (trace,) = [t for t in traj.traces if set(t.metadata.get("completion_ids", [])) & main_ids]
    assert set(trace.metadata["completion_ids"]) == main_ids
    assert audit(traj, run.records).ok


V2_SPAWN = "collaboration__spawn_agent"  # multi_agent_v2's tools are the `collaboration` namespace
V2_WAIT = "collaboration__wait_agent"


def delegating_v2_script(body: dict[str, Any]) -> Reply:
    """`delegating_script` for `features.multi_agent_v2`: the sub-agent (no parent history) gets its task as
    an `agent_message` ("Message Type: NEW_TASK ... Payload:" and the task), the parent its answer the same
    way after `wait_agent`."""
    messages = body["messages"]
    outputs = [m["content"] for m in messages if m["role"] == "tool"]
    users = [str(m["content"]) for m in messages if m["role"] == "user"]
    if any("Message Type: NEW_TASK" in u and SUBTASK in u for u in users):
        if not outputs:
            return Reply("On it.", tool_calls=[(TOOL, '{"cmd":"printf sub > sub.txt"}')])
        return Reply("sub.txt is written.")
    if not outputs:
        spawn = {"message": SUBTASK, "task_name": "helper", "fork_turns": "none"}
        return Reply("Delegating sub.txt.", tool_calls=[(V2_SPAWN, json.dumps(spawn))])
    if len(outputs) == 1:
        return Reply("Waiting for it.", tool_calls=[(V2_WAIT, json.dumps({"timeout_ms": 60000}))])
    if len(outputs) == 2:
        return Reply("Now hello.txt.", tool_calls=[(TOOL, '{"cmd":"printf main > hello.txt"}')])
    return Reply("Done.")


@pytest.mark.cli
@needs_npm
async def test_codex_multi_agent_v2_spawns_through_the_collaboration_namespace(tmp_path: Path) -> None:
    """`features.multi_agent_v2` (the preset's `config` setting): the sub-agent tools are the
    `collaboration` namespace, and agents talk in `agent_message` items, which reach the policy as user
    turns; the sub-agent's calls are tagged `subagent`, the main loop stays one trace."""
    settings = {"config": {"features": {"multi_agent_v2": True}}}
    run = await run_preset(
        tmp_path, "codex", settings, delegating_v2_script, expect="mainsub", check="cat hello.txt sub.txt"
    )
    assert run.result.status == SessionStatus.COMPLETED and run.result.reward == 1.0, run.result.reason
    tags = [run.preset.classify(r) for r in run.records]
    sub = [r for r, t in zip(run.records, tags, strict=True) if t == ("side_call", "subagent")]
    main = [r for r, t in zip(run.records, tags, strict=True) if not t]
    assert len(sub) == 2 and len(main) == 4, tags
    task = [i for i in sub[0].request["input"] if i.get("type") == "agent_message"]
    assert task and task[0]["content"][-1] == {"type": "encrypted_content", "encrypted_content": SUBTASK}
    answer = [i for i in main[-2].request["input"] if i.get("type") == "agent_message"]
    assert answer and "sub.txt is written." in json.dumps(answer[-1])
    assert "sub.txt is written." in str(main[-2].upstream_request["messages"][-1]["content"])
    traj = Trajectory.model_validate(run.result.trajectory)
    main_ids = {r.completion_id for r in main}
    (trace,) = [t for t in traj.traces if set(t.metadata.get("completion_ids", [])) & main_ids]
    assert set(trace.metadata["completion_ids"]) == main_ids
    assert audit(traj, run.records).ok


# -- tool search over deferred MCP tools ---------------------------------------------------------------------

# What Codex's developer message says once the MCP server's tools can be found ("Added deferred tool
# namespaces:", or "Deferred tool namespaces:" in a part of the first one when the server was up before the
# first call, as on a loaded machine: seen in CI).
MCP_READY = "tool namespaces:\n- mcp__weather"
SEARCH_ARGS = '{"query":"forecast"}'  # compact: not what json.dumps of Codex's echoed object gives


def searching_script(body: dict[str, Any]) -> Reply:
    """The policy: wait (a second at a time) until Codex says its MCP server's tools are there (a developer
    message, "Added deferred tool namespaces: ..."; a search before finds nothing), search for a forecast
    tool, call what it loaded, write the answer to hello.txt, stop."""
    messages = body["messages"]
    calls = [c["function"] for m in messages for c in m.get("tool_calls") or []]
    results = [str(m["content"]) for m in messages if m["role"] == "tool"]
    last = results[-1] if results else ""
    if any("hello.txt" in c["arguments"] for c in calls):
        return Reply("Done.")
    if "sunny in Oslo" in last:
        return Reply("Writing it down.", tool_calls=[(TOOL, '{"cmd":"printf sunny > hello.txt"}')])
    if "mcp__weather__forecast" in last:
        return Reply("Asking.", tool_calls=[("mcp__weather__forecast", '{"city":"Oslo"}')])
    # Codex sends developer messages as parts: their str() would escape the newline MCP_READY has.
    ready = any(
        MCP_READY in t for m in messages if m["role"] == "system" for t in cli_common.texts(m["content"])
    )
    if ready and "tool_search" not in [c["name"] for c in calls]:
        return Reply("Searching.", tool_calls=[("tool_search", SEARCH_ARGS)])
    if len(calls) < 120 and "tool_search" not in [c["name"] for c in calls]:
        return Reply("Waiting for the tools.", tool_calls=[(TOOL, '{"cmd":"sleep 1"}')])
    return Reply("There is no forecast tool.")


@pytest.mark.cli
@needs_npm
async def test_codex_searches_its_deferred_mcp_tools_and_calls_what_it_loaded(tmp_path: Path) -> None:
    """The policy's `tool_search` call reaches Codex as a `tool_search_call`; Codex runs the search over its
    MCP server's tools and sends the loaded namespace back; the policy calls `mcp__weather__forecast`, which
    reaches Codex as `forecast` in namespace `mcp__weather` and runs on the MCP server. The main loop stays
    one trace: the loaded tools are in the tool message, not in `tools`, and the search call's own text
    (compact JSON, which Codex echoes as an object) is restored. The MCP server, the feature flags and the
    catalog model come from the preset's `config` setting."""
    await asyncio.to_thread(mcp_weather.install)  # before Codex waits for the server
    settings = {"config": mcp_weather.codex_config()}
    run = await run_preset(tmp_path, "codex", settings, searching_script, expect="sunny")
    assert run.result.status == SessionStatus.COMPLETED and run.result.reward == 1.0, run.result.reason
    last = run.records[-1].request["input"]
    searches = [i for i in last if i.get("type") == "tool_search_call"]
    outputs = [i for i in last if i.get("type") == "tool_search_output"]
    assert searches and all(s["arguments"] == {"query": "forecast"} for s in searches)
    assert [t["name"] for t in outputs[-1]["tools"]] == ["mcp__weather"]
    called = [i for i in last if i.get("type") == "function_call" and i["name"] == "forecast"]
    assert [(i.get("namespace"), i["arguments"]) for i in called] == [("mcp__weather", '{"city":"Oslo"}')]
    answers = [i["output"] for i in last if i.get("type") == "function_call_output"]
    assert any("sunny in Oslo" in str(a) for a in answers)
    assert all("tool_search" in [t["function"]["name"] for t in r.tools or []] for r in run.records)
    # Codex echoed the search's arguments as an object; the policy's compact text was put back.
    assert any("quirk:tool_arguments_restored" in r.flags for r in run.records[1:])
    traj = Trajectory.model_validate(run.result.trajectory)
    (trace,) = traj.traces
    assert set(trace.metadata["completion_ids"]) == {r.completion_id for r in run.records}
    assert audit(traj, run.records).ok


class CodexOnline(codex.CodexHarness):
    """The preset without its switches for other traffic (analytics, plugins, web search, update check)."""

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        await super().setup(runtime, ctx)
        text = codex.config_toml(ctx).split("\n[analytics]")[0]
        for line in ('web_search = "disabled"\n', "check_for_update_on_startup = false\n"):
            text = text.replace(line, "")
        await cli_common.write_file(runtime, f"{self.codex_home(ctx)}/config.toml", text)


@pytest.mark.cli
@needs_npm
@needs_strace
@pytest.mark.parametrize("harness", ["codex", "tests.test_cli_codex:CodexOnline"])
async def test_no_connection_but_the_gateway(tmp_path: Path, harness: str) -> None:
    """Every socket Codex opens (DNS included) goes to the gateway; without the preset's switches it looks
    up a name (the control shows the trace would catch it)."""
    result, addresses, port = await traced_against_gateway(tmp_path, harness, tool_script(TOOL, ARGS))
    assert result.exit_code == 0, result.stderr[-2000:]
    if harness == "codex":
        assert addresses == {("127.0.0.1", port)}
    else:
        assert addresses - {("127.0.0.1", port)}, addresses


def test_the_config_setting_merges_into_config_toml_and_names_the_model(tmp_path: Path) -> None:
    overlay = {"model": "gpt-5.5", "features": {"tool_search": True}, "mcp_servers": {"w": {"command": "w"}}}
    harness = get_harness("codex", {"config": overlay, "binary": "/opt/codex"})
    c = ctx(tmp_path)
    config = tomllib.loads(codex.config_toml(c, overlay=harness.config))  # type: ignore[attr-defined]
    assert config["features"] == {"plugins": False, "tool_search": True}  # merged, not replaced
    assert config["mcp_servers"] == {"w": {"command": "w"}} and config["model"] == "gpt-5.5"
    assert config["model_providers"]["polar"]["base_url"] == "http://127.0.0.1:9999/v1"
    assert " -m gpt-5.5 " in harness.command(c)


def test_config_points_codex_at_the_gateway(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    config = tomllib.loads(codex.config_toml(c, context_window=4096, reasoning_effort="low", max_retries=1))
    assert config["model_reasoning_effort"] == "low"
    assert config["model_providers"]["polar"].pop("request_max_retries") == 1
    assert config["model_providers"]["polar"].pop("stream_max_retries") == 1
    assert config["model"] == "served-model" and config["model_provider"] == "polar"
    assert config["model_providers"]["polar"] == {
        "name": "polar",
        "base_url": "http://127.0.0.1:9999/v1",
        "env_key": "POLAR_SESSION_ID",
        "wire_api": "responses",
    }
    assert config["model_context_window"] == 4096
    assert config["analytics"] == {"enabled": False} and config["features"] == {"plugins": False}
    harness = get_harness("codex", {"binary": "/opt/codex"})
    env = harness.env(c)
    assert env["POLAR_SESSION_ID"] == "sess-x" and env["CODEX_HOME"] == f"{tmp_path}/home/.codex"
    assert get_harness("codex", {}).env(ctx(tmp_path, env={"CODEX_HOME": "/mine"}))["CODEX_HOME"] == "/mine"
    command = harness.command(c)
    assert isinstance(command, str)
    assert command.startswith(
        "/opt/codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox"
    )
    assert command.endswith(f" - < {tmp_path}/home/.polar/instruction.md")  # "-do it" never parsed as a flag


@given(st.text(st.characters(exclude_categories=("Cs",))))
def test_any_model_name_stays_one_toml_string(model: str) -> None:
    """Quotes, backslashes, control characters (DEL too) and astral characters round-trip exactly."""
    text = codex.config_toml(ctx(Path("/x"), model=model, gateway_url=f"http://h:1/{model}x"))
    config = tomllib.loads(text)
    assert config["model"] == model
    assert config["model_providers"]["polar"]["base_url"] == f"http://h:1/{model}x/v1"


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"binary": "codex"}, "settings.binary"),
        ({"context_window": 0}, "settings.context_window"),
        ({"context_window": True}, "settings.context_window"),
        ({"reasoning_effort": "max"}, "settings.reasoning_effort"),
        ({"max_retries": -1}, "settings.max_retries"),
        ({"sandbox": "none"}, "unknown settings"),
        ({"config": ["features"]}, "settings.config must be a mapping"),
        (
            {"config": {"model_providers": {"polar": {"base_url": "http://x"}}}},
            "settings.config.model_providers",
        ),
        ({"config": {"model_provider": "openai"}}, "settings.config.model_provider"),
        ({"config": {"model": ""}}, "settings.config.model"),
        ({"config": {"features": {"x": None}}}, "settings.config cannot be written as TOML"),
    ],
)
def test_bad_settings_are_refused_by_name(settings: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        get_harness("codex", settings)


def test_command_needs_setup_first(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="before setup"):
        get_harness("codex").command(ctx(tmp_path))


def _record(tools: list[dict[str, object]] | None, last: str, request: Any = None) -> CompletionRecord:
    messages = [{"role": "developer", "content": "be good"}, {"role": "user", "content": last}]
    return CompletionRecord(
        "s", 0, "c", "responses", 0.0, request or {}, {"messages": messages}, [1], [2], [-0.1], "stop",
        {"role": "assistant", "content": "x"}, tools, {}, "m", "m",
    )  # fmt: skip


def test_classify_tags_compaction_sub_agents_and_tool_less_calls() -> None:
    harness = get_harness("codex")
    tool = [{"type": "function", "function": {"name": TOOL, "parameters": {}}}]
    assert harness.classify(_record(tool, "fix the bug")) == ()
    assert harness.classify(_record(None, "fix the bug")) == ("side_call",)
    prompt = "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary"
    assert harness.classify(_record(tool, prompt)) == ("side_call", "compaction")
    spawned = {"client_metadata": {"x-openai-subagent": "collab_spawn", "x-codex-parent-thread-id": "t"}}
    assert harness.classify(_record(tool, "SUBTASK", spawned)) == ("side_call", "subagent")
    for other in ({"client_metadata": {"session_id": "t"}}, {"client_metadata": "x"}, ["not a body"]):
        assert harness.classify(_record(tool, "fix the bug", other)) == ()


async def test_setup_that_cannot_write_fails_naming_the_file(tmp_path: Path) -> None:
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path / "rt"), "codex-setup")
    await runtime.start()
    try:
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("a file where the home should be")
        bad = ctx(tmp_path, home=str(blocker / "home"))
        with pytest.raises(RuntimeFailure, match=r"could not write .*[.]codex/config[.]toml"):
            await get_harness("codex", {"binary": "/opt/codex"}).setup(runtime, bad)
        # A run that left no transcript (the CLI never started) is reported as such, not as an error.
        meta = await get_harness("codex", {"binary": "/opt/codex"}).post_run(runtime, ctx(tmp_path))
        assert meta["transcripts"] == 0
    finally:
        await runtime.stop()


# -- the task's MCP servers and skills ---------------------------------------------------------------------


@pytest.mark.cli
@needs_npm
@pytest.mark.parametrize("backend", ["local", pytest.param("bwrap", marks=needs_bwrap)])
async def test_codex_runs_the_tasks_mcp_server_and_reads_its_skill(tmp_path: Path, backend: str) -> None:
    """`agent.mcp_servers` and `agent.skills`: the policy calls `mcp__weather__forecast` (Codex offers the
    server's tools as the namespace `mcp__weather`, flattened upstream) and the forecast comes back in the
    next request. The server starts 5 s late; without `required` Codex 0.171.0 sent its first two calls
    without its tools (measured), here the first already has them. In bwrap the server only starts where
    a file of the host's /tmp is not visible, so it ran inside the sandbox."""
    await asyncio.to_thread(mcp_weather.install)
    hidden = tmp_path / "host-only"
    hidden.write_text("a server that sees this runs outside the sandbox")
    run = await run_preset(
        tmp_path,
        "codex",
        {},
        ext.weather_script("mcp__weather__forecast"),
        expect=None,
        backend=backend,
        agent=ext.agent_fields(delay_s=5, unseen=hidden if backend == "bwrap" else None),
        runtime={"read_only_paths": [str(ext.SCRIPT.parent)]} if backend == "bwrap" else None,
    )
    ext.check_weather_run(run, "codex", "responses", "mcp__weather__forecast")
