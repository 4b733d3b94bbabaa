"""`polar generate`: a task file run end to end (rollout server, node, shell harness, the fake vLLM behind a
real gateway), sessions filtered by reward, conversations and token rows written and loaded by `datasets`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from tests.conftest import SERVED_MODEL
from tests.extras_support import one_line_error, polar_without
from tests.fakes.fake_vllm import Reply
from tests.node_support import fake_policy

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}

# A minimal tool-using agent through the official openai SDK: it runs the shell commands the model asks
# for in its workdir and sends their output back as tool results, until the model answers in text.
AGENT = """
import os, subprocess, sys, openai
client = openai.OpenAI(max_retries=0)
tools = [{"type": "function", "function": {"name": "shell", "description": "Run a shell command.",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
messages = [{"role": "user", "content": sys.argv[1]}]
for _ in range(4):
    r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, tools=tools)
    msg = r.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    if not msg.tool_calls:
        break
    for call in msg.tool_calls:
        import json
        cmd = json.loads(call.function.arguments)["command"]
        out = subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout
        messages.append({"role": "tool", "tool_call_id": call.id, "content": out or "(no output)"})
print(msg.content)
"""


def policy(body: dict[str, Any]) -> Reply:
    """Write the instruction's last word into hello.txt with the shell tool, then say so."""
    messages = body["messages"]
    if messages[-1]["role"] == "tool":
        return Reply(content="Done.")
    word = str(messages[-1]["content"]).split()[-1]
    return Reply(
        tool_calls=[("shell", json.dumps({"command": f"printf {word} > hello.txt"}, separators=(",", ":")))]
    )


def polar(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polar", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def task(task_id: str, word: str, agent: Path) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "instruction": f"write {word}",
        "num_samples": 2,
        "timeout_seconds": 60,
        # the agent program next to the task file, uploaded into the sandbox as a user ships one
        "runtime": {"prepare": [{"type": "upload", "src": agent.name, "dst": agent.name}]},
        "agent": {
            "harness": "shell",
            "settings": {"command": f"{sys.executable} {agent.name} {{instruction}}"},
        },
        "evaluator": {"strategy": "test_on_output", "config": {"command": "cat hello.txt", "expect": "good"}},
    }


def test_generate_keeps_rewarded_sessions_as_messages_and_tokens(tmp_path: Path) -> None:
    import datasets  # 0.6 s to import: paid by the tests that read with it, not by every worker

    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text(yaml.safe_dump({"tasks": [task("pass", "good", agent), task("fail", "bad", agent)]}))
    out = tmp_path / "out"
    with fake_policy(policy) as (url, backend):
        proc = polar(
            "generate", str(taskfile), "--backend", url, "--model", SERVED_MODEL, "--out", str(out),
            "--min-reward", "1",
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(backend.requests) == 8  # 4 sessions x (tool call, answer)

    every = [orjson.loads(line) for line in (out / "results.jsonl").read_bytes().splitlines()]
    assert sorted((r["task_id"], r["reward"]) for r in every) == [("fail", 0.0)] * 2 + [("pass", 1.0)] * 2
    passed = {r["session_id"] for r in every if r["task_id"] == "pass"}

    for name in ("messages.jsonl", "messages.parquet"):
        ds = datasets.load_dataset(
            name.split(".")[1].replace("jsonl", "json"),
            data_files=str(out / name),
            cache_dir=str(tmp_path / "hf"),
        )["train"]
        assert set(ds["session_id"]) == passed and ds.num_rows == 2, name
        for row in ds:
            messages = row["messages"] if name.endswith("jsonl") else json.loads(row["messages"])
            assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"], messages
            assert messages[0]["content"] == "write good"
            (call,) = messages[1]["tool_calls"]
            assert json.loads(call["function"]["arguments"]) == {"command": "printf good > hello.txt"}
            assert messages[2]["tool_call_id"] == call["id"] and messages[2]["content"] == "(no output)"
            assert messages[3]["content"] == "Done."
            assert row["reward"] == 1.0 and row["task_id"] == "pass" and row["assistant_turns"] == 2
            assert json.loads(row["tools"])[0]["function"]["name"] == "shell"

    tokens = datasets.load_dataset(
        "parquet", data_files=str(out / "tokens.parquet"), cache_dir=str(tmp_path / "hf")
    )["train"]
    assert set(tokens["session_id"]) == passed and tokens.num_rows == 2  # one merged trace per session
    jsonl = [orjson.loads(line) for line in (out / "tokens.jsonl").read_bytes().splitlines()]
    for row, same in zip(tokens, jsonl, strict=True):
        assert row == same
        mask, logprobs = row["loss_mask"], row["response_logprobs"]
        assert 0 in mask and mask[0] == 1 and mask[-1] == 1  # the tool result is masked, both turns trained
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
        assert row["group_id"] == "pass" and row["reward"] == 1.0 and row["status"] == "COMPLETED"
    assert "accepted" in proc.stdout and "2 (50.0 %)" in proc.stdout


def test_generate_filter_by_status_and_failures(tmp_path: Path) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    taskfile = tmp_path / "tasks.yaml"
    one = {**task("pass", "good", agent), "num_samples": 1}
    taskfile.write_text(yaml.safe_dump({"tasks": [one]}))
    out = tmp_path / "out"
    with fake_policy(policy) as (url, _):
        # JSON Lines from a remote backend needs neither pyarrow nor the engine extra: run without them
        proc = polar_without(
            ("pyarrow", "torch", "transformers"), "generate", str(taskfile), "--backend", url, "--model", SERVED_MODEL,
            "--out", str(out), "--status", "ERROR", "--status", "TIMEOUT", "--format", "jsonl",
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "messages.jsonl").read_bytes() == b"" and (out / "tokens.jsonl").read_bytes() == b""
    assert not (out / "messages.parquet").exists()
    assert "0 (0.0 %)" in proc.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text("tasks:\n  - task_id: a\n    instruction: x\n    runtime:\n      backend: vm\n")
    proc = polar("generate", str(bad), "--backend", "http://127.0.0.1:9", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and f"{bad}:5: tasks[0].runtime.backend" in proc.stderr
    proc = polar("generate", str(taskfile), "--backend", "http://127.0.0.1:9", "--capacity", "0")
    assert proc.returncode == 2 and "--capacity" in proc.stderr
    proc = polar("generate", str(taskfile), "--status", "DONE")
    assert proc.returncode == 2 and "--status" in proc.stderr


@pytest.mark.parametrize("fmt", ["both", "parquet"])
def test_generate_without_pyarrow_fails_before_any_session(tmp_path: Path, fmt: str) -> None:
    """Parquet output (the default, `--format both`) where pyarrow cannot be imported: one line naming the
    extra, exit 2, before a single session runs (it used to die after running all of them)."""
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text(yaml.safe_dump({"tasks": [task("pass", "good", agent)]}))
    out = tmp_path / "out"
    formats = () if fmt == "both" else ("--format", fmt)
    with fake_policy(policy) as (url, app):
        proc = polar_without(
            ("pyarrow",), "generate", str(taskfile), "--backend", url, "--model", SERVED_MODEL,
            "--out", str(out), *formats,
        )  # fmt: skip
        assert app.requests == []
    line = one_line_error(proc)
    assert "Parquet output needs pyarrow" in line and "pip install 'polar-rl[export]'" in line
    assert not out.exists()
