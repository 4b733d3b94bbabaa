"""Responses tools -> Chat function tools: plain functions, custom (free-form) tools, namespace groups.

A Responses `namespace` tool groups function and custom tools under one name; the model calls a member as
`{"type": "function_call", "namespace": "multi_agent_v1", "name": "spawn_agent", ...}` (the openai SDK's
`NamespaceTool` and `ResponseFunctionToolCall.namespace`). Codex 0.171.0 sends its sub-agent tools this way
and routes a call by the pair (namespace, name): a call without the namespace is an "unsupported call".
Chat has no groups, so each member goes upstream as one function under a flat name, `namespace__name`:

- `__` joins the two because Chat tool names must match `^[a-zA-Z0-9_-]{1,64}$` on OpenAI's API (a dot,
  `multi_agent_v1.spawn_agent`, is refused there), and it is Codex's own way of writing a qualified tool
  name (`mcp__server__tool`); a namespace that already ends in `__` (`mcp__server__`) gets no second one.
- The flat name depends on the pair alone, so the history Codex sends back (its `function_call` items carry
  the namespace) renders to the same prompt every turn, and prefix merging keeps working.
- `__` can also occur inside the names, so two pairs (or a pair and a top-level tool) may flatten to one
  name; that request is refused with a 400 naming the second one, never answered with a call routed to
  the wrong tool.
- The namespace's own description has no place in a Chat tool list and is not sent upstream.

A `tool_search` tool with `execution: "client"` (Codex 0.171.0 with deferred MCP tools) goes upstream as the
function `tool_search`; its calls and results are `responses_input`'s and `responses_render`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polar.gateway.dialects.tool_schema import check_tool_schema
from polar.gateway.errors import invalid
from polar.jsontypes import JSON

SEPARATOR = "__"
# The Chat name of a client-executed `tool_search` tool (the name Codex's own tool router uses for it).
SEARCH = "tool_search"


def flat_name(namespace: str, name: str) -> str:
    """The Chat function name of member `name` of `namespace`."""
    return f"{namespace}{name}" if namespace.endswith(SEPARATOR) else f"{namespace}{SEPARATOR}{name}"


@dataclass(frozen=True, slots=True)
class ConvertedTools:
    """The Chat tools of a Responses request and what the answer needs to call them back in kind."""

    tools: list[dict[str, Any]]
    custom: frozenset[str]  # Chat names of custom tools (their calls answer as `custom_tool_call`)
    dropped: list[str]  # hosted tools the policy cannot call
    callable: frozenset[str]  # every Chat name the policy may call
    namespaced: dict[str, tuple[str, str]]  # Chat name -> (namespace, name) of namespace members
    search: bool = False  # a client-executed `tool_search` went upstream as the function SEARCH


def convert_tools(specs: list[Any] | None, field: str = "tools") -> ConvertedTools:
    """`field` names the list in errors: `tools`, or `input[i].tools` for what a tool search loaded."""
    tools: list[dict[str, Any]] = []
    custom: set[str] = set()
    dropped: list[str] = []
    namespaced: dict[str, tuple[str, str]] = {}
    where: dict[str, str] = {}  # Chat name -> the first field that declared it (for a clash's message)
    search = False

    def add(spec: JSON, field: str, name: str, member: bool) -> None:
        # Two top-level tools of one name pass as before (a call to it goes back as it came); a clash
        # involving a namespace member would route a call to the wrong tool.
        if name in where and (member or name in namespaced or (search and name == SEARCH)):
            raise invalid(
                f"Invalid value for '{field}.name': it is called {name!r} upstream, like {where[name]}; "
                f"namespace members are called as <namespace>{SEPARATOR}<name>, a client tool_search as "
                f"{SEARCH}.",
                f"{field}.name",
            )
        where.setdefault(name, field)
        if spec["type"] == "tool_search":
            tools.append(_function({**spec, "name": SEARCH}, field, name))
        elif spec["type"] == "custom":
            tools.append(_custom_as_function(spec, name))
            custom.add(name)
        else:
            tools.append(_function(spec, field, name))

    for i, t in enumerate(specs or ()):
        kind = t["type"]
        if kind in ("function", "custom"):
            add(t, f"{field}[{i}]", t["name"], member=False)
        elif kind == "namespace":
            for j, inner in enumerate(t["tools"]):
                name = flat_name(t["name"], inner["name"])
                add(inner, f"{field}[{i}].tools[{j}]", name, member=True)
                namespaced[name] = (t["name"], inner["name"])
        elif kind == "tool_search" and t.get("execution", "client") in ("client", None):
            # Refused if anything else is called `tool_search`: its calls answer as `tool_search_call`.
            add(t, f"{field}[{i}]", SEARCH, member=True)
            search = True
        else:
            # Hosted tools (web_search, file_search, ...) run on OpenAI's side; the policy cannot call them.
            dropped.append(t.get("name") or kind)
    return ConvertedTools(tools, frozenset(custom), dropped, frozenset(where), namespaced, search)


def _function(t: Any, field: str, name: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    params = t.get("parameters")
    if params is not None:
        check_tool_schema(params, field, t["name"], "parameters")
    fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def _custom_as_function(t: Any, name: str) -> dict[str, Any]:
    """A free-form (custom) tool as a function with one string argument `input`.

    Codex declares `apply_patch` this way, with a Lark grammar; the grammar goes into the argument's
    description so a policy trained through chat templates can see the format it must follow.
    """
    desc = "The raw input for this tool."
    fmt = t.get("format") or {}
    if fmt.get("type") == "grammar" and fmt.get("definition"):
        syntax = fmt.get("syntax", "")
        desc = f"The raw input for this tool. It must match this {syntax} grammar:\n{fmt['definition']}"
    fn: dict[str, Any] = {"name": name}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    fn["parameters"] = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": desc}},
        "required": ["input"],
        "additionalProperties": False,
    }
    return {"type": "function", "function": fn}


def convert_tool_choice(choice: JSON, callable_names: frozenset[str]) -> JSON:
    """A forced tool by its Chat name; a namespace member is named by `namespace` and `name`."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice["type"] in ("function", "custom"):
        name = choice.get("name")
        if not name:
            raise invalid("Missing required parameter: 'tool_choice.name'.", "tool_choice.name")
        namespace = choice.get("namespace")
        if namespace:
            name = flat_name(namespace, name)
        if name not in callable_names:
            message = (
                f"Invalid value for 'tool_choice.name': {choice['name']!r} is not one of the request's tools."
            )
            raise invalid(message, "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise invalid(f"Unsupported value for 'tool_choice.type': {choice['type']!r}.", "tool_choice.type")
