"""A finished session's outcome as text a judge reads: the agent's final answer, its diff, files the task
names, and (on request) the transcript.

Everything here comes from the agent and is untrusted: it is read, never run. Files are read *inside* the
agent's runtime (its sandbox bounds what a symlink can reach) and only where their real path stays in the
workdir; the diff is the `command` evaluator's (`agent_diff`), so a workdir the agent made undiffable is its
fault (reward 0). Long parts keep their head and tail, cut the same way every time, so identical outcomes
give identical judge prompts (and hit the judge's cache).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polar.evaluate.support import require_environment, tail
from polar.runtime.base import Runtime
from polar.trajectory.models import Trace, Trajectory

# Reads one file inside the runtime: exit 3 missing, 4 its real path leaves the workdir, 5 not a regular
# file; else at most $2 bytes of it, base64 (binary content survives the text channel).
_READ = r"""
p=$1 max=$2
root=$(pwd -P)
real=$(realpath -e -- "$p" 2>/dev/null) || exit 3
case "$real/" in "$root"/*) ;; *) exit 4 ;; esac
[ -f "$real" ] || exit 5
head -c "$max" -- "$real" | base64 -w0
"""
_FILE_PROBLEMS = {
    3: "(no such file)",
    4: "(not read: its real path leaves the workdir)",
    5: "(not a regular file)",
}


@dataclass(frozen=True)
class Part:
    """One section of the outcome: a title ("final answer", "diff", "file notes.md") and its text."""

    title: str
    text: str
    cut: int = 0  # characters left out of the middle

    def summary(self) -> dict[str, Any]:
        return {"title": self.title, "chars": len(self.text), "cut_chars": self.cut}


def clip(title: str, text: str, limit: int) -> Part:
    """`text` as a part of at most about `limit` characters: its head and tail, the middle cut and said."""
    if len(text) <= limit:
        return Part(title, text)
    half = limit // 2
    cut = len(text) - 2 * half
    return Part(title, f"{text[:half]}\n[... {cut} characters cut ...]\n{text[-half:]}", cut)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _seqs(trace: Trace) -> list[int]:
    seqs = trace.metadata.get("seqs")
    return [s for s in seqs if isinstance(s, int)] if isinstance(seqs, list) else []


def main_trace(trajectory: Trajectory) -> Trace | None:
    """The trace holding the session's last policy call (side calls left out): where its answer ends."""
    side = set((trajectory.metadata.get("side_calls") or {}).get("completion_ids") or ())
    traces = [
        t
        for t in trajectory.traces
        if not side or not set(t.metadata.get("completion_ids") or ()) <= side  # all side calls: skip
    ]
    if not traces:
        return None
    return max(enumerate(traces), key=lambda it: (max(_seqs(it[1]), default=-1), it[0]))[1]


def final_answer(trajectory: Trajectory) -> str:
    """The text of the agent's last assistant message ("" when it never answered in text)."""
    trace = main_trace(trajectory)
    if trace is None:
        return ""
    for message in reversed([*trace.prompt_messages, *trace.response_messages]):
        if message.get("role") == "assistant":
            return _text(message.get("content"))
    return ""


def transcript(trajectory: Trajectory) -> str:
    """The main trace's conversation, one block per message: `[role]` then its text and tool calls."""
    trace = main_trace(trajectory)
    if trace is None:
        return ""
    blocks = []
    for m in [*trace.prompt_messages, *trace.response_messages]:
        lines = [f"[{m.get('role', '?')}]", _text(m.get("content"))]
        for call in m.get("tool_calls") or ():
            fn = (call.get("function") or {}) if isinstance(call, dict) else {}
            lines.append(f"-> {fn.get('name', '?')}({fn.get('arguments', '')})")
        blocks.append("\n".join(line for line in lines if line))
    return "\n\n".join(blocks)


async def read_file(runtime: Runtime, path: str, limit: int, timeout_s: float) -> Part:
    """`path` (relative to the workdir) as the agent left it, read in its runtime; a missing file, one
    leading out of the workdir or no regular file is said in the part (the judge grades its absence)."""
    title = f"file {path}"
    argv = ["bash", "--noprofile", "--norc", "-c", _READ, "polar-read", path, str(limit + 1)]
    res = await runtime.exec(argv, timeout_s=timeout_s)
    require_environment(res, f"reading {path}")
    if res.exit_code in _FILE_PROBLEMS:
        return Part(title, _FILE_PROBLEMS[res.exit_code])
    if res.exit_code != 0 or res.timed_out:
        return Part(title, f"(could not be read: exit {res.exit_code} {tail(res.stderr.strip(), 200)})")
    data = base64.b64decode(res.stdout.strip())
    text = data[:limit].decode("utf-8", errors="replace")
    return Part(title, text + ("\n[... the rest of the file cut ...]" if len(data) > limit else ""))


def render(parts: Sequence[Part]) -> str:
    """The parts as one block of Markdown sections."""
    return "\n\n".join(f"## {p.title}\n{p.text if p.text.strip() else '(empty)'}" for p in parts)
