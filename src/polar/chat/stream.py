"""Reading an answer while it is sampled: reasoning and content as soon as no later token can change them,
tool calls when it ends. The embedded engine's chat stream and the gateway's rendered stream
(`polar.gateway.render`) read answers this way, so a streamed answer says what the whole one says."""

from __future__ import annotations

from typing import Any

from polar.chat.reasoning import ReasoningStream
from polar.chat.tool_parsers import ParsedCall, ToolParser


class ToolStream:
    """Passes content through until a tool call starts; buffers the call text for parsing at the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.buf = ""
        self.sent = 0
        self.in_call = False

    def feed(self, delta: str, final: bool) -> str:
        self.buf += delta
        if self.in_call:
            return ""
        start = self.parser.call_start(self.buf)
        if start >= 0:
            self.in_call = True
            end = start
        else:
            end = len(self.buf) - (0 if final else self.parser.pending(self.buf))
        end = max(end, self.sent)
        out, self.sent = self.buf[self.sent : end], end
        return out


class AnswerStream:
    """One answer's text, fed as it comes (`feed`), read as `Template.read` reads it whole: reasoning (open
    when the prompt left a thought open), then content, with the tool calls parsed by the last `feed`
    (`final`). A call that does not parse is handed back as content, with the parser's `error`; what a
    parser keeps as content after the text already sent (Llama 3's plain JSON answer) is sent then."""

    def __init__(
        self, reasoning: bool, opened: bool, parser: ToolParser | None, tools: list[dict[str, Any]] | None
    ) -> None:
        self.reasoning = ReasoningStream(opened) if reasoning else None
        self.tools = ToolStream(parser) if parser is not None else None
        self.tool_list = tools
        self.content = ""
        self.thought = ""
        self.calls: list[ParsedCall] = []
        self.error: str | None = None

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[ParsedCall]]:
        """(reasoning, content, calls) the text so far adds; calls only with `final`."""
        reasoning, content = self.reasoning.feed(text, final=final) if self.reasoning else ("", text)
        calls: list[ParsedCall] = []
        if self.tools is not None:
            content = self.tools.feed(content, final=final)
            if final and self.tools.in_call:
                parsed = self.tools.parser.parse(self.tools.buf, self.tool_list)
                if parsed.error is not None:
                    self.error = parsed.error
                    content += self.tools.buf[self.tools.sent :]
                else:
                    calls = list(parsed.calls)
                    # What the parser keeps as content after the text sent before the call (if any).
                    sent, kept = self.tools.buf[: self.tools.sent], parsed.content or ""
                    if kept.startswith(sent):
                        content += kept[len(sent) :]
        self.thought += reasoning
        self.content += content
        self.calls += calls
        return reasoning, content, calls
