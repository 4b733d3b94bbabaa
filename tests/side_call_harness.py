"""A harness for the side-call tests: the `shell` preset whose `classify` tags a no-tools call as a side call
(by import path: `tests.side_call_harness:SideCallShell`), and the script it runs."""

from __future__ import annotations

from polar.harness.shell import ShellHarness
from polar.store.records import CompletionRecord

TITLE_SYSTEM = "You write a five-word title for the conversation."

# Two calls through the official openai SDK, as a CLI with a title side call makes them: a title request
# with no tools and its own system prompt, then the main loop's call with tools.
SIDE_CALL_SCRIPT = f"TITLE_SYSTEM = {TITLE_SYSTEM!r}\n" + (
    """
import os, openai
client = openai.OpenAI(max_retries=0)
model = os.environ["OPENAI_MODEL"]
title = client.chat.completions.create(model=model, messages=[
    {"role": "system", "content": TITLE_SYSTEM},
    {"role": "user", "content": "fix the bug"},
])
tools = [{"type": "function", "function": {"name": "shell", "description": "run a command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
main = client.chat.completions.create(model=model, tools=tools, messages=[
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "fix the bug"},
])
print("TITLE:", title.choices[0].message.content)
print("MAIN:", main.choices[0].message.content)
"""
)


class SideCallShell(ShellHarness):
    """`shell`, with calls that carry no tools tagged as title side calls (the main loop always has tools)."""

    name = "side_call_shell"

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        if record.tools:
            return ()
        messages = record.upstream_request.get("messages") or []
        system = " ".join(str(m.get("content")) for m in messages if m.get("role") == "system")
        return ("side_call", "title") if TITLE_SYSTEM in system else ("side_call",)


class BrokenClassifier(SideCallShell):
    """A preset whose classifier raises: the gateway must answer the call with an error, not a traceback."""

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        raise RuntimeError("classifier bug")
