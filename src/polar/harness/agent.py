"""The built-in agent: a small, readable reference of what a harness does.

    python -m polar.harness.agent --instruction-file F --workdir D --transcript T.jsonl [options]

It talks to the model only through the official `openai` SDK (Chat Completions), configured the way every
harness is under polar: `OPENAI_BASE_URL`, `OPENAI_API_KEY` (the session id) and `OPENAI_MODEL` from the
environment. The loop is the one every coding agent runs: system prompt and instruction, call the model with
tools, execute each tool call, send the results back as `tool` messages, repeat. It stops on `finish`, on a
final answer without tool calls, or after `--max-turns`. History goes back exactly as the model sent it
(arguments text verbatim, reasoning included), so each prompt extends the previous one token for token and
`prefix_merging` rebuilds the session as one trace.

Exit codes: 0 finished; 1 bad usage; 2 model API error (message on stderr); 3 turn limit reached.
Every step is appended (and flushed) to the JSONL transcript, so a killed run still leaves what it did.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

import openai

EXIT_FINISHED, EXIT_USAGE, EXIT_API_ERROR, EXIT_MAX_TURNS = 0, 1, 2, 3

SYSTEM_PROMPT = (
    "You are a coding agent working in a repository. Use the tools to inspect and change files and to run "
    "commands. When the task is done, call `finish` with a short summary of what you did."
)


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    props = {p: {"type": "string", "description": d} for p, d in params.items()}
    schema = {"type": "object", "properties": props, "required": list(params)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    _tool("bash", "Run a bash command in the working directory.", command="The command line."),
    _tool("read_file", "Read a text file.", path="Path, relative to the working directory."),
    _tool(
        "write_file",
        "Create or overwrite a text file.",
        path="Path, relative to the working directory.",
        content="The file's full new content.",
    ),
    _tool("finish", "End the task.", summary="What was done."),
]
_PARAMS = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}


class Tools:
    """The tools' implementations; every failure becomes text the model reads, never an exception."""

    def __init__(self, workdir: Path, timeout_s: float, max_output: int) -> None:
        self.workdir, self.timeout_s, self.max_output = workdir, timeout_s, max_output

    def run(self, name: str, raw_arguments: str) -> tuple[str, bool]:
        """(output, ok) for one call; bad names and arguments are answered so the model sees its mistake."""
        if name not in _PARAMS:
            return f"error: unknown tool {name!r}; the tools are {sorted(_PARAMS)}", False
        try:
            args = json.loads(raw_arguments or "{}")
        except json.JSONDecodeError as e:
            return f"error: the arguments of {name} are not valid JSON ({e}); send a JSON object", False
        required = _PARAMS[name]
        if not isinstance(args, dict) or any(not isinstance(args.get(p), str) for p in required):
            return f"error: {name} takes a JSON object with string fields {required}", False
        try:
            return getattr(self, name)(**{p: args[p] for p in required}), True
        except OSError as e:
            return f"error: {e}", False

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_output:
            return text
        half = self.max_output // 2
        return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"

    def _path(self, path: str) -> Path:
        return self.workdir / path

    def bash(self, command: str) -> str:
        # A new session so a timeout kills the whole tree: a background child holding the pipe open would
        # otherwise keep communicate() waiting past the timeout.
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=self.timeout_s)
            head = f"exit code: {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            head = f"exit code: 124 (timed out after {self.timeout_s:g} s)"
        return f"{head}\n{self._clip(out.decode(errors='replace'))}"

    def read_file(self, path: str) -> str:
        return self._clip(self._path(path).read_text(errors="replace"))

    def write_file(self, path: str, content: str) -> str:
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        return f"wrote {len(content.encode())} bytes to {path}"

    def finish(self, summary: str) -> str:
        return "finished"


class Transcript:
    def __init__(self, fh: TextIO) -> None:
        self.fh = fh

    def write(self, kind: str, **fields: Any) -> None:
        self.fh.write(json.dumps({"type": kind, **fields}, ensure_ascii=False) + "\n")
        self.fh.flush()


def _call_model(client: openai.OpenAI, request: dict[str, Any], stream: bool) -> dict[str, Any]:
    """One Chat Completions call; the assistant message as a dict ready to go back into the history."""
    if not stream:
        msg = client.chat.completions.create(**request).choices[0].message
        out: dict[str, Any] = msg.model_dump(exclude_none=True)  # keeps extras such as reasoning_content
        return {k: v for k, v in out.items() if k not in ("refusal", "annotations", "audio", "function_call")}
    out = {"role": "assistant"}
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(**request, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.model_dump(exclude_none=True)
        for key in ("content", "reasoning_content", "reasoning"):
            if key in delta:
                out[key] = out.get(key, "") + delta[key]
        for tc in delta.get("tool_calls", []):
            call = calls.setdefault(
                tc["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = tc.get("id") or call["id"]
            fn = tc.get("function", {})
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def run(args: argparse.Namespace, transcript: Transcript) -> int:
    model = os.environ.get("OPENAI_MODEL") or args.model
    if not model:
        print("polar agent: no model: set OPENAI_MODEL or pass --model", file=sys.stderr)
        return EXIT_USAGE
    instruction = Path(args.instruction_file).read_text()
    tools = Tools(Path(args.workdir), args.bash_timeout, args.max_output)
    client = openai.OpenAI(max_retries=args.max_retries, timeout=args.request_timeout)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": args.system_prompt or SYSTEM_PROMPT},
        {"role": "user", "content": instruction},
    ]
    pairs = (("temperature", args.temperature), ("max_tokens", args.max_tokens))
    extra = {k: v for k, v in pairs if v is not None}
    transcript.write("start", model=model, instruction=instruction, max_turns=args.max_turns)
    for turn in range(1, args.max_turns + 1):
        request = {"model": model, "messages": messages, "tools": TOOLS, **extra}
        try:
            message = _call_model(client, request, args.stream)
        except openai.OpenAIError as e:
            transcript.write("end", finished=False, reason="api_error", turns=turn - 1, error=str(e))
            print(f"polar agent: model API error on turn {turn}: {e}", file=sys.stderr)
            return EXIT_API_ERROR
        messages.append(message)
        transcript.write("assistant", turn=turn, message=message)
        calls = message.get("tool_calls") or []
        if not calls:
            summary = message.get("content") or ""
            transcript.write("end", finished=True, reason="final_answer", turns=turn, summary=summary)
            return EXIT_FINISHED
        summary = None
        for call in calls:
            name, raw = call["function"]["name"], call["function"]["arguments"]
            output, ok = tools.run(name, raw)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
            transcript.write("tool", turn=turn, name=name, arguments=raw, output=output, ok=ok)
            if name == "finish" and ok:
                summary = json.loads(raw)["summary"]
        if summary is not None:
            transcript.write("end", finished=True, reason="finish", turns=turn, summary=summary)
            return EXIT_FINISHED
    transcript.write("end", finished=False, reason="max_turns", turns=args.max_turns)
    print(f"polar agent: stopped after {args.max_turns} turns without finishing", file=sys.stderr)
    return EXIT_MAX_TURNS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m polar.harness.agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--instruction-file", required=True)
    p.add_argument("--workdir", default=".")
    p.add_argument("--transcript", required=True, help="JSONL file to append every step to")
    p.add_argument("--model", help="used when OPENAI_MODEL is unset")
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--bash-timeout", type=float, default=120.0, help="seconds per bash command")
    p.add_argument("--max-output", type=int, default=16000, help="characters of tool output kept")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--max-retries", type=int, default=2, help="SDK retries on connection errors and 5xx")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--system-prompt")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.max_turns < 1 or args.max_output < 1 or args.bash_timeout <= 0:
        print("polar agent: needs --max-turns >= 1, --max-output >= 1, --bash-timeout > 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        path = Path(args.transcript)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            return run(args, Transcript(fh))
    except OSError as e:
        print(f"polar agent: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
