"""The served model's chat format in the gateway: render a conversation, render only its new messages, and
read an answer's sampled ids back into content, reasoning and tool calls.

Rendering only the new messages is what lets a session's prompt be its previous prompt, the ids sampled
after it, and the rendered delta (`polar.gateway.render.chain`). Templates are not append-only (Qwen3's
drops the reasoning of turns before the last user message; several re-place the tool list), so the delta
is not "render all, cut the old rendering off". It is cut out of a rendering behind a fixed two-message
conversation: a user turn and an assistant turn whose content is `_MARK`; the delta starts after the
end-of-turn marker that closes that assistant turn (Qwen's `<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's
`<end_of_turn>`), found once at load time. Whatever the template puts after its end-of-turn marker (Qwen's
"\\n") is the delta's start, so the ids sampled up to and including the marker join it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar.chat.reasoning import prompt_opens_thought, split_reasoning
from polar.chat.render import ChatTemplateError, render_chat
from polar.chat.tool_parsers import ParsedCall, ToolParser, detect_parser, get_parser
from polar.jsontypes import JSON

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_MARK = "polar-delta-base-7f3a"
_BASE: list[dict[str, Any]] = [{"role": "user", "content": "."}, {"role": "assistant", "content": _MARK}]
# A conversation and a tool whose places in a rendering say where the template puts the tool list.
_FIRST, _LATER, _TOOL = "polar-first-user-7f3a", "polar-later-user-7f3a", "polar_probe_tool_7f3a"
_PROBE_TOOLS = [
    {"type": "function", "function": {"name": _TOOL, "description": ".", "parameters": {"type": "object"}}}
]


class TemplateUnusable(ValueError):
    """The model's tokenizer cannot render for the gateway (no chat template, no end-of-turn marker)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What the sampled ids say: content, reasoning and tool calls; `error` when a call did not parse."""

    content: str | None
    reasoning: str | None
    calls: tuple[ParsedCall, ...]
    error: str | None
    text: str  # the sampled text the parsers read (the end-of-turn marker left out)


class Template:
    """A tokenizer with a chat template (any object with transformers' `apply_chat_template`, `encode`,
    `decode`), its tool-call parser and whether its answers may open with reasoning."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, tool_parser: str = "auto", reasoning: str = "auto"
    ) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise TemplateUnusable("the model's tokenizer has no chat template to render with")
        self.parser: ToolParser | None = (
            detect_parser(template)
            if tool_parser == "auto"
            else get_parser(tool_parser)
            if tool_parser
            else None
        )
        vocab = tokenizer.get_vocab()
        if reasoning == "auto":
            self.reasoning = "<think>" in vocab and "</think>" in vocab
        elif reasoning in ("none", ""):
            self.reasoning = False
        elif reasoning in ("qwen3", "deepseek_r1", "think"):
            self.reasoning = True
        else:
            raise ValueError(f"unknown reasoning parser {reasoning!r}; use auto, qwen3, deepseek_r1 or none")
        self.end_of_turn = self._end_of_turn(vocab)
        self.moves_tools = self._moves_tools()
        self.end_id: int = vocab[self.end_of_turn]
        stops = {self.end_id}
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            stops.add(eos)
        self.stop_ids = frozenset(stops)

    @classmethod
    def load(cls, source: str | Path, tool_parser: str = "auto", reasoning: str = "auto") -> Template:
        """The tokenizer of the model at `source`: a folder, or a model id already in the local Hugging Face
        cache (nothing is downloaded: a gateway renders with what the server loaded)."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        except OSError as exc:
            raise TemplateUnusable(
                f"{source}: no tokenizer there (a model folder, or a model id in the local Hugging Face "
                f"cache): {str(exc).splitlines()[0]}"
            ) from None
        return cls(tokenizer, tool_parser, reasoning)

    def _end_of_turn(self, vocab: dict[str, int]) -> str:
        """The special token that closes an assistant turn: the first one after the base turn's content."""
        text = self.render(_BASE, None, None, generation_prompt=False)
        at = text.rfind(_MARK)
        if at < 0:
            raise TemplateUnusable("the chat template does not render an assistant turn's content")
        tail = text[at + len(_MARK) :]
        special: list[str] = sorted(
            (t for t in getattr(self.tokenizer, "all_special_tokens", []) if t in vocab),
            key=len,
            reverse=True,
        )
        stripped = tail.lstrip()
        for token in special:
            if stripped.startswith(token):
                return token
        raise TemplateUnusable(
            f"the chat template ends an assistant turn with {tail[:40]!r}, which starts with no special token"
        )

    def _moves_tools(self) -> bool:
        """Whether the tool list follows the last user message (Mistral's templates put it right before
        that message), so that a conversation's rendering changes before its end when a user message is
        added: a chain would keep the list where it was first rendered and add it again before the new
        message. Qwen's (system prompt) and Llama 3's (first user message) keep it in place."""
        conversation = [
            {"role": "user", "content": _FIRST},
            {"role": "assistant", "content": "."},
            {"role": "user", "content": _LATER},
        ]
        try:
            text = self.render(conversation, _PROBE_TOOLS, None)
        except ChatTemplateError:
            return False
        tool, first = text.find(_TOOL), text.find(_FIRST)
        return tool > first >= 0

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
        generation_prompt: bool = True,
    ) -> str:
        """The whole conversation's text, as vLLM renders it for chat (`polar.chat.render`)."""
        return render_chat(
            self.tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=generation_prompt,
            chat_template_kwargs=kwargs,
        )

    def delta(
        self, new: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None
    ) -> str:
        """The text of `new` messages (and the generation prompt) after a finished assistant turn, starting
        right after its end-of-turn marker."""
        text = self.render([*_BASE, *new], tools, kwargs)
        at = text.find(_MARK)
        end = text.find(self.end_of_turn, at) if at >= 0 else -1
        if end < 0:
            raise ChatTemplateError("the chat template did not render the base turn before new messages")
        return text[end + len(self.end_of_turn) :]

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text; the template wrote every special token itself (as vLLM tokenizes chat)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def parser_for(self, tools: list[dict[str, Any]] | None, tool_choice: JSON) -> ToolParser | None:
        """The tool-call parser for a call offering `tools` (none when it offers none, or forbids calls)."""
        return self.parser if tools and tool_choice != "none" else None

    def read(
        self,
        ids: Sequence[int],
        prompt_tail: str,
        tools: list[dict[str, Any]] | None,
        tool_choice: JSON,
    ) -> Answer:
        """Content, reasoning and tool calls of sampled `ids`, the way the engine's chat serving reads them
        (`polar.engine.serving_chat`): reasoning first (open when the prompt left a thought open), then the
        parser over the content; a call that does not parse leaves the content whole and sets `error`."""
        body = list(ids[:-1]) if ids and ids[-1] in self.stop_ids else list(ids)
        parser = self.parser_for(tools, tool_choice)
        special = parser is not None and parser.needs_special_tokens
        text = str(self.tokenizer.decode(body, skip_special_tokens=not special))
        if self.reasoning:
            reasoning, content = split_reasoning(text, prompt_opens_thought(prompt_tail))
        else:
            reasoning, content = None, text or None
        if parser is None or not content:
            return Answer(content, reasoning, (), None, text)
        parsed = parser.parse(content, tools)
        if parsed.error is not None:
            return Answer(content, reasoning, (), parsed.error, text)
        return Answer(parsed.content, reasoning, tuple(parsed.calls), None, text)
