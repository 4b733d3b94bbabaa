"""The `claude_code` preset: the real Claude Code CLI (pinned, from npm) on a real node, gateway and runtime.

The fake vLLM plays the model. Its script finds Claude Code's own `Bash` tool in the request and makes the
CLI run it to create `hello.txt`, then answers in text; the CLI, its tools, the gateway, the store and the
runtimes (`local`, and `bwrap` where only the gateway is reachable) are all real. Unit tests at the top
need no CLI: settings, command, environment, and `classify` on requests Claude Code 2.1.197 really sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from polar.harness import HarnessContext, get_harness
from polar.harness.presets import claude_code
from polar.harness.presets.claude_code import ClaudeCodeHarness
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.runtime import LocalRuntime, RuntimeSpec, make_runtime
from polar.runtime.base import ExecResult
from polar.store.records import CompletionRecord
from polar.store.sqlite import SQLiteStore
from polar.task import UploadAction
from polar.trajectory import audit, build
from tests import extension_support as ext
from tests import mcp_weather
from tests.conftest import FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply
from tests.node_support import fake_policy, running_node, shell_task, spec
from tests.preset_run_support import harness_image, run_preset

DATA = Path(__file__).parent / "data"
HELLO = "hello from claude code"
# Compact JSON: what Claude Code re-sends in its history is `input` re-serialized.
WRITE = json.dumps(
    {"command": f"printf '{HELLO}' > hello.txt", "description": "write"}, separators=(",", ":")
)
EXPLORE = '{"description":"look around","prompt":"List the files here.","subagent_type":"Explore"}'
ASK_AGENT = "Use an Explore agent first"
ASK_SEARCH = "Load the TaskCreate tool first"
SEARCH = '{"query":"select:TaskCreate","max_results":3}'
ASK_PDF = "Read doc.pdf first"
MAIN_MARK = "You are an interactive agent"  # 2.1.197's main-loop system prompt (subagents have their own)


def ctx(**kw: Any) -> HarnessContext:
    base: dict[str, Any] = dict(
        session_id="sess-1",
        gateway_url="http://127.0.0.1:8123/",
        model="policy-m",
        instruction="Create hello.txt",
        home="/h",
        workdir="/w",
        artifacts="/a",
    )
    return HarnessContext(**(base | kw))


def record(request: dict[str, Any], model: str | None = None) -> CompletionRecord:
    return CompletionRecord(
        session_id="s",
        seq=0,
        completion_id="c",
        dialect="anthropic",
        created_at=0.0,
        request=request,
        upstream_request={},
        prompt_ids=[1],
        response_ids=[2],
        response_logprobs=[-0.5],
        finish_reason="stop",
        response_message={"role": "assistant", "content": "x"},
        tools=None,
        usage={},
        model_requested=model or str(request.get("model")),
        model_served="served",
    )


# ---- no CLI needed ----------------------------------------------------------------------------------


def test_registry_and_docs_constants() -> None:
    harness = get_harness("claude_code", {})
    assert isinstance(harness, ClaudeCodeHarness) and harness.name == "claude_code"
    assert claude_code.PRESET is ClaudeCodeHarness
    assert (claude_code.PACKAGE, claude_code.VERSION, claude_code.BINARY) == (
        "@anthropic-ai/claude-code",
        "2.1.197",
        "claude",
    )
    assert claude_code.DIALECT == "anthropic"
    assert all(isinstance(c, str) and c for c in (claude_code.CONFIGURES, claude_code.LIMITS))


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"allowed_tool": ["Bash"]}, "unknown settings ['allowed_tool']"),
        ({"allowed_tools": "Bash"}, "settings.allowed_tools"),
        ({"allowed_tools": []}, "settings.allowed_tools"),
        ({"allowed_tools": ["Bash,Edit"]}, "no commas"),
        ({"small_model": ""}, "settings.small_model"),
        ({"skip_permissions": "yes"}, "settings.skip_permissions"),
        ({"skip_permissions": True, "allowed_tools": ["Bash"]}, "no effect with skip_permissions"),
        ({"binary": 3}, "settings.binary"),
    ],
)
def test_bad_settings_name_the_setting(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match="claude_code harness") as info:
        get_harness("claude_code", settings)
    assert words in str(info.value)


def test_command_passes_the_instruction_after_double_dash() -> None:
    harness = ClaudeCodeHarness({"allowed_tools": ["Bash", "Read"], "binary": "/opt/claude"})
    nasty = '--help -p "x" $(touch pwned)'
    assert harness.command(ctx(instruction=nasty)) == [
        "/opt/claude",
        "-p",
        "--allowedTools",
        "Bash,Read",
        "--debug-file",
        "/a/claude-debug.log",
        "--",
        nasty,
    ]


def test_skip_permissions_replaces_the_allowed_list() -> None:
    harness = ClaudeCodeHarness({"skip_permissions": True, "binary": "/opt/claude"})
    command = harness.command(ctx())
    assert command[:3] == ["/opt/claude", "-p", "--dangerously-skip-permissions"]
    assert "--allowedTools" not in command
    assert harness.env(ctx())["IS_SANDBOX"] == "1"  # 2.1.197 refuses the flag as root without it
    assert "IS_SANDBOX" not in ClaudeCodeHarness({}).env(ctx())


def test_env_points_every_model_tier_at_the_gateway() -> None:
    env = ClaudeCodeHarness({}).env(ctx(env={"DISABLE_TELEMETRY": "0", "EXTRA": "1"}))
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8123" and env["ANTHROPIC_API_KEY"] == "sess-1"
    assert env["CLAUDE_CONFIG_DIR"] == "/h/.claude" and env["HOME"] == "/h"
    tiers = ("MODEL", "SMALL_FAST_MODEL", "DEFAULT_HAIKU_MODEL", "DEFAULT_SONNET_MODEL", "DEFAULT_OPUS_MODEL")
    assert {env[f"ANTHROPIC_{t}"] for t in tiers} == {"policy-m"}
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["DISABLE_AUTOUPDATER"] == "1"
    assert env["DISABLE_TELEMETRY"] == "0" and env["EXTRA"] == "1"  # the task's env has the last word
    small = ClaudeCodeHarness({"small_model": "frozen-small"}).env(ctx())
    assert small["ANTHROPIC_SMALL_FAST_MODEL"] == small["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "frozen-small"
    assert small["ANTHROPIC_MODEL"] == "policy-m"


def real_requests() -> dict[str, dict[str, Any]]:
    side = json.loads((DATA / "claude_code_2_1_197_side_calls.json").read_text())
    main = json.loads((DATA / "claude_code_2_1_197_turn2.json").read_text())
    return {"main": main, "title": side["title"], "subagent": side["subagent"]}


def test_classify_real_requests() -> None:
    reqs = real_requests()
    harness = ClaudeCodeHarness({})
    assert harness.classify(record(reqs["main"])) == ()
    assert harness.classify(record(reqs["title"])) == ("side_call", "title")
    assert harness.classify(record(reqs["subagent"])) == ("side_call", "subagent")
    # Any other call without tools is small-model work, not the main loop.
    other = {**reqs["title"], "system": [{"type": "text", "text": "Summarize this."}]}
    assert harness.classify(record(other)) == ("side_call", "small_model")
    # What classify must survive: another dialect's body, odd shapes.
    assert harness.classify(record({"messages": [], "system": 7})) == ("side_call", "small_model")
    assert harness.classify(record({"tools": [{"name": "t"}], "system": [3, {"text": None}]})) == ()


async def test_classify_by_small_model_name_only_when_it_differs() -> None:
    main = real_requests()["main"]

    class NoExec:  # setup's config write succeeds; nothing else is run
        async def exec(self, *a: Any, **kw: Any) -> ExecResult:
            return ExecResult(0, "", "")

    harness = ClaudeCodeHarness({"small_model": "frozen-small", "binary": "/opt/claude"})
    await harness.setup(NoExec(), ctx())  # type: ignore[arg-type]
    assert harness.classify(record(main, model="frozen-small")) == ("side_call", "small_model")
    assert harness.classify(record(main, model="policy-m")) == ()
    same = ClaudeCodeHarness({"small_model": "policy-m", "binary": "/opt/claude"})
    await same.setup(NoExec(), ctx())  # type: ignore[arg-type]
    assert same.classify(record(main, model="policy-m")) == ()


# ---- the real CLI -----------------------------------------------------------------------------------


def script(body: dict[str, Any]) -> Reply:
    """Claude Code's turns, told apart by what it sends: the main loop writes the file with Bash (after
    one Explore subagent when the instruction asks for it), a subagent answers, a call without tools gets
    a title."""
    tools = [t["function"]["name"] for t in body.get("tools") or []]
    msgs = body["messages"]
    if not tools:
        return Reply(content='{"title":"Create hello file"}')
    if MAIN_MARK not in str(msgs[0].get("content")):
        return Reply(content="Only hello.txt may be here.")
    assert "Bash" in tools, tools
    results = sum(1 for m in msgs if m["role"] == "tool")
    first: list[tuple[str, str]] = []
    if ASK_AGENT in str(msgs) and "Agent" in tools:
        first = [("Agent", EXPLORE)]
    elif ASK_SEARCH in str(msgs) and "ToolSearch" in tools:
        first = [("ToolSearch", SEARCH)]
    elif ASK_PDF in str(msgs):
        cwd = re.search(r"Primary working directory: (\S+)", str(msgs[0]["content"]))
        assert cwd, "2.1.197 names its working directory in the system prompt"
        first = [("Read", json.dumps({"file_path": f"{cwd[1]}/doc.pdf"}, separators=(",", ":")))]
    plan = [*first, ("Bash", WRITE)]
    if results < len(plan):
        return Reply(content="On it.", reasoning="Use the tool.", tool_calls=[plan[results]])
    return Reply(content="Created hello.txt.")


def cli_task(backend: str, instruction: str, image: str | None = None, **agent: Any) -> Any:
    return shell_task(
        "unused",
        instruction=instruction,
        timeout_seconds=120,
        runtime={"backend": backend, "image": image},
        agent={"harness": "claude_code", "settings": {}, **agent},
        evaluator={"strategy": "test_on_output", "config": {"command": "cat hello.txt", "expect": HELLO}},
    )


async def run_cli(tmp_path: Path, task: Any, sid: str) -> tuple[SessionResult, list[CompletionRecord], Path]:
    with fake_policy(script) as (url, _):
        # The test's folder is this node's upload root (a PDF is uploaded from it).
        async with running_node(url, tmp_path, keep="artifacts", upload_roots=(tmp_path,)) as node:
            await node.submit(spec(task, sid))
            result = await node.wait(sid)
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions(sid)
        assert store.failures(sid) == []
    (kept,) = (tmp_path / "runtimes").iterdir()
    return result, records, kept / "artifacts"


def assert_main_loop_is_one_trace(records: list[CompletionRecord], harness: ClaudeCodeHarness) -> None:
    main = [r for r in records if not harness.classify(r)]
    assert len(main) >= 2
    for r in records:
        assert r.trainable and r.prompt_ids and r.response_ids and r.response_logprobs, r.seq
        assert r.request["stream"] is True  # Claude Code streams; the gateway answered in SSE
        assert r.model_requested == "fake-policy"
    assert all("quirk:claude_code_billing_header" in r.flags for r in main)
    trajectory = build(main, strategy="prefix_merging")
    report = audit(trajectory, main)
    assert report.ok, report.errors
    assert len(trajectory.traces) == 1, [t.metadata for t in trajectory.traces]
    trace = trajectory.traces[0]
    assert report.trainable_tokens == sum(len(r.response_ids or []) for r in main) == sum(trace.loss_mask)
    assert 0 in trace.loss_mask[trace.loss_mask.index(1) :]  # the tool output between turns, masked


@pytest.mark.cli
@pytest.mark.parametrize(
    "backend",
    [
        "local",
        pytest.param(
            "bwrap",
            marks=pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
        ),
        pytest.param("docker", marks=pytest.mark.containers),
        pytest.param("podman", marks=pytest.mark.containers),
    ],
)
async def test_claude_code_writes_the_file_through_the_gateway(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """bwrap, docker, podman (network=gateway): the sandbox has only its own loopback, where only the
    gateway answers, so a session that completes made no connection to anything but the gateway. In a
    container the pinned binary runs from the node's tool cache, mounted read-only."""
    task = cli_task(backend, "Create hello.txt with a greeting.", image=harness_image(request, backend))
    result, records, artifacts = await run_cli(tmp_path, task, f"sess-cc-{backend}")
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reason is None or "exited with code" not in result.reason
    assert result.reward == 1.0  # `cat hello.txt` printed exactly HELLO: Claude Code's Bash tool ran
    harness = ClaudeCodeHarness({})
    assert [harness.classify(r) for r in records] == [(), ()]
    assert_main_loop_is_one_trace(records, harness)
    assert len(records[0].request["tools"]) > 20 and records[0].request["thinking"] == {"type": "adaptive"}
    # Claude Code's own transcript and debug log are in the artifacts.
    (transcript,) = result.metadata["harness"]["transcripts"]
    lines = (artifacts / claude_code.PROJECTS / transcript).read_text().splitlines()
    assert any(WRITE[:20] in line or "hello.txt" in line for line in lines)
    assert (artifacts / claude_code.DEBUG_LOG).stat().st_size > 0


@pytest.mark.cli
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
async def test_claude_code_skip_permissions_runs_as_root_in_bwrap(tmp_path: Path) -> None:
    """`skip_permissions` in a sandbox: 2.1.197 takes --dangerously-skip-permissions as root (IS_SANDBOX)."""
    task = cli_task("bwrap", "Create hello.txt with a greeting.", settings={"skip_permissions": True})
    result, records, _ = await run_cli(tmp_path, task, "sess-cc-skip")
    assert result.status == SessionStatus.COMPLETED and result.reward == 1.0, result.reason
    assert len(records) == 2 and all(r.trainable for r in records)


@pytest.mark.cli
async def test_claude_code_side_calls_are_tagged_and_the_main_loop_stays_one_trace(tmp_path: Path) -> None:
    """Non-essential traffic on (the session-title call) and an Explore subagent: both are tagged side
    calls, every call is captured with token data, and the main loop is still one trace."""
    task = cli_task(
        "local",
        f"{ASK_AGENT}, then create hello.txt with a greeting.",
        env={"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": ""},
    )
    result, records, _ = await run_cli(tmp_path, task, "sess-cc-side")
    assert result.status == SessionStatus.COMPLETED and result.reward == 1.0, result.reason
    harness = ClaudeCodeHarness({})
    tags = [harness.classify(r) for r in records]
    assert sorted(tags) == [(), (), (), ("side_call", "subagent"), ("side_call", "title")], tags
    side = {harness.classify(r)[1]: r for r in records if harness.classify(r)}
    # The haiku tier is pointed at the served model too: no call asks for a real Claude model.
    assert {r.model_requested for r in records} == {"fake-policy"}
    assert side["subagent"].request["tools"] and not side["title"].request["tools"]
    assert_main_loop_is_one_trace(records, harness)
    # All calls together: the subagent and the title are traces of their own.
    everything = build(records, strategy="prefix_merging")
    assert len(everything.traces) == 3 and audit(everything, records).ok


@pytest.mark.cli
async def test_claude_code_tool_search_reaches_the_policy_as_text(tmp_path: Path) -> None:
    """ENABLE_TOOL_SEARCH=true: the ToolSearch result's `tool_reference` block gets through the gateway as
    the loaded tool's definition (it used to be a 400 that ended the run)."""
    task = cli_task(
        "local", f"{ASK_SEARCH}, then create hello.txt with a greeting.", env={"ENABLE_TOOL_SEARCH": "true"}
    )
    result, records, _ = await run_cli(tmp_path, task, "sess-cc-search")
    assert result.status == SessionStatus.COMPLETED and result.reward == 1.0, result.reason
    assert len(records) == 3 and all(r.trainable for r in records)
    after_search = records[1].upstream_request["messages"]
    (loaded,) = [m for m in after_search if m["role"] == "tool"]
    assert (
        loaded["content"].startswith('<functions>\n<function>{"description":')
        and "TaskCreate" in loaded["content"]
    )
    # The loaded tool joins `tools` from then on, so the tool list rendered into the prompt changes: the
    # main loop splits where it did (one trace before, one after), and the audit still passes.
    assert "TaskCreate" not in str(records[0].tools) and "TaskCreate" in str(records[1].tools)
    trajectory = build(records, strategy="prefix_merging")
    report = audit(trajectory, records)
    assert report.ok, report.errors
    assert [t.metadata["seqs"] for t in trajectory.traces] == [[0], [1, 2]]


def tiny_pdf() -> bytes:
    """A valid one-page PDF saying "hello pdf" (hand-built: no PDF library needed)."""
    stream = b"BT /F1 12 Tf 20 100 Td (hello pdf) Tj ET"
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 200] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = b"%PDF-1.4\n", []
    for i, obj in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (i, obj)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    return out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)


@pytest.mark.cli
async def test_claude_code_reads_a_pdf_through_the_gateway(tmp_path: Path) -> None:
    """Read on a PDF sends a base64 `document` block (it used to be a 400 that ended the run): the policy
    gets a text note that the document is there, and the main loop stays one trace."""
    pdf = tmp_path / "doc.pdf"
    pdf.write_bytes(tiny_pdf())
    task = cli_task("local", f"{ASK_PDF}, then create hello.txt with a greeting.")
    task = task.model_copy(
        update={
            "runtime": task.runtime.model_copy(
                update={"prepare": [UploadAction(src=str(pdf), dst="doc.pdf")]}
            )
        }
    )
    result, records, _ = await run_cli(tmp_path, task, "sess-cc-pdf")
    assert result.status == SessionStatus.COMPLETED and result.reward == 1.0, result.reason
    assert len(records) == 3
    note = f'<document media_type="application/pdf" bytes="{len(tiny_pdf())}">(binary content not shown)</document>'
    assert note in str(records[1].upstream_request["messages"][-1])
    assert_main_loop_is_one_trace(records, ClaudeCodeHarness({}))


_INET_CONNECT = re.compile(r"connect\(\d+, \{sa_family=AF_INET6?, (?P<addr>[^}]*)\}")


@pytest.mark.cli
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
async def test_claude_code_connects_to_nothing_but_the_gateway(
    tmp_path: Path, gateway: Gateway, fake_backend: FakeBackend
) -> None:
    """Every socket the CLI opens, traced: with the preset's switches the only internet-family connects
    go to the gateway's port on loopback (no DNS, telemetry, update check or error reporting)."""
    fake_backend.app.reset(script)
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path), "cc-strace", gateway_url=gateway.url)
    assert isinstance(runtime, LocalRuntime) and runtime.gateway_url is not None
    await runtime.start()
    try:
        sid = gateway.new_session()
        context = HarnessContext(
            session_id=sid,
            gateway_url=runtime.gateway_url,  # the gateway's port on the sandbox's own loopback
            model="fake-policy",
            instruction="Create hello.txt with a greeting.",
            home=str(runtime.home),
            workdir=str(runtime.workdir),
            artifacts=str(runtime.artifacts),
        )
        harness = ClaudeCodeHarness({})
        await harness.setup(runtime, context)
        log = tmp_path / "connect.log"
        traced = ["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(log), *harness.command(context)]
        result = await runtime.exec(traced, env=harness.env(context), timeout_s=120)
        assert result.exit_code == 0, result.stderr
        assert (runtime.workdir / "hello.txt").read_text() == HELLO
    finally:
        await runtime.stop()
    port = urlsplit(gateway.url).port
    targets = {m["addr"] for m in _INET_CONNECT.finditer(log.read_text())}
    assert targets == {f'sin_port=htons({port}), sin_addr=inet_addr("127.0.0.1")'}
    assert len(gateway.completions(sid)) == 2


@pytest.mark.cli
async def test_claude_code_runs_the_tasks_mcp_server_and_reads_its_skill(tmp_path: Path) -> None:
    """`agent.mcp_servers` (`--mcp-config`, the server's tools allowed) and `agent.skills` (in the Skill
    tool's listing): the policy calls `mcp__weather__forecast` and the forecast comes back in the next
    request. The server starts 5 s late; 2.1.197 under `-p` sent its first two calls without its tools
    (measured) unless told to wait (MCP_CONNECTION_NONBLOCKING=0): here the first already has them."""
    await asyncio.to_thread(mcp_weather.install)
    run = await run_preset(
        tmp_path,
        "claude_code",
        {},
        ext.weather_script("mcp__weather__forecast"),
        expect=None,
        agent=ext.agent_fields(delay_s=5),
    )
    ext.check_weather_run(run, "claude_code", "anthropic", "mcp__weather__forecast")
