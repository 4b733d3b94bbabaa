"""Telling a user what is wrong with a file they wrote: the line a YAML error is really at, the validation
error worth naming, and "did you mean" for a near miss.

    line, problem = yaml_problem(exc)            # an unclosed quote: the line where it was opened
    loc, message = validation_problem(exc, Task) # ('num_sample',), "Extra inputs are not permitted
                                                 #  (did you mean num_samples?)"

Used by the task files (`polar.rollout.taskfile`) and the training config (`polar.train.config`), so
`polar run`, `generate`, `train` and `submit` word their errors alike.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Sequence
from typing import Annotated, Literal, TypeGuard, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails


def yaml_problem(exc: yaml.YAMLError) -> tuple[int | None, str]:
    """(1-based line, what is wrong) of a YAML syntax error.

    PyYAML marks where it noticed the problem (`problem_mark`) and where the construct it was reading
    started (`context_mark`). For a construct that never ends (an unclosed quote or bracket) the problem is
    noticed at the end of the file, far from the mistake: that one is reported where it was opened."""
    problem = str(getattr(exc, "problem", None) or exc).strip()
    context = getattr(exc, "context", None)
    problem_mark = getattr(exc, "problem_mark", None)
    context_mark = getattr(exc, "context_mark", None)
    at_end = "end of stream" in problem or "<stream end>" in problem
    if at_end and problem_mark is not None and (bracket := _unclosed_bracket(problem_mark)) is not None:
        opened_at, char = bracket
        return opened_at + 1, f"a {char!r} opened here is never closed ({problem})"
    if at_end and context_mark is not None:
        what = "a quote opened here is never closed" if "quoted scalar" in str(context) else f"{context}"
        return context_mark.line + 1, f"{what} ({problem})"
    if problem_mark is not None and (opened := _quote_ending_at(problem_mark)) is not None:
        return opened + 1, f"a quote opened here runs on to line {problem_mark.line + 1} ({problem})"
    line = problem_mark.line + 1 if problem_mark is not None else None
    if (
        context
        and context_mark is not None
        and problem_mark is not None
        and context_mark.line != problem_mark.line
    ):
        problem += f" ({context} at line {context_mark.line + 1})"
    return line, problem


def _tokens(mark: yaml.Mark) -> list[yaml.Token]:
    """The tokens of the text `mark` points into, up to where scanning fails."""
    text = getattr(mark, "buffer", None)
    tokens: list[yaml.Token] = []
    if isinstance(text, str):
        try:
            for token in yaml.scan(text.rstrip("\0")):
                tokens.append(token)
        except yaml.YAMLError:
            pass
    return tokens


def _unclosed_bracket(mark: yaml.Mark) -> tuple[int, str] | None:
    """(0-based line, bracket) of the flow collection (`[` or `{`) still open at the end of the text."""
    stack: list[tuple[int, str]] = []
    for token in _tokens(mark):
        if isinstance(token, (yaml.FlowSequenceStartToken, yaml.FlowMappingStartToken)):
            stack.append(
                (token.start_mark.line, "[" if isinstance(token, yaml.FlowSequenceStartToken) else "{")
            )
        elif isinstance(token, (yaml.FlowSequenceEndToken, yaml.FlowMappingEndToken)) and stack:
            stack.pop()
    return stack[0] if stack else None


def _quote_ending_at(mark: yaml.Mark) -> int | None:
    """The 0-based line where a quoted scalar spanning several lines and ending on `mark`'s line starts:
    a quote left open that the next quote in the file closed, the error showing up only after it."""
    start = None
    for token in _tokens(mark):
        if token.start_mark.line > mark.line:
            break
        if (
            isinstance(token, yaml.ScalarToken)
            and token.style in ("'", '"')
            and token.start_mark.line < token.end_mark.line == mark.line
        ):
            start = token.start_mark.line
    return start


# -- walking a pydantic model along an error's location -----------------------------------------------------
#
# An annotation is any type form (a class, `X | None`, `list[X]`, `Annotated[X, ...]`): typed `object`.


def _members(annotation: object) -> list[object]:
    """The alternatives of an annotation: `X | Y | None` -> [X, Y]; `Annotated[X, ...]` -> [X]."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [m for a in get_args(annotation) for m in _members(a) if a is not type(None)]
    return [annotation]


def _is_model(annotation: object) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _tags(model: type[BaseModel]) -> set[str]:
    """The literal values of a model's fields: where a discriminated union puts a member's tag in `loc`."""
    out: set[str] = set()
    for info in model.model_fields.values():
        if get_origin(info.annotation) is Literal:
            out.update(str(v) for v in get_args(info.annotation))
    return out


def _step(annotation: object, step: str | int) -> object:
    members = _members(annotation)
    for a in members:
        if _is_model(a) and isinstance(step, str) and step in a.model_fields:
            return a.model_fields[step].annotation
        origin = get_origin(a)
        if origin in (list, tuple, set, frozenset, Sequence) and isinstance(step, int):
            args = get_args(a)
            return args[0] if args else None
        if origin is dict and isinstance(step, str):
            args = get_args(a)
            return args[1] if len(args) == 2 else None
    if isinstance(step, str):  # a discriminated union names the member it tried by its tag
        for a in members:
            if _is_model(a) and step in _tags(a):
                return a
    return None


def _is_tag(annotation: object, step: str | int) -> bool:
    members = _members(annotation)
    return (
        isinstance(step, str)
        and not any(_is_model(a) and step in a.model_fields for a in members)
        and any(_is_model(a) and step in _tags(a) for a in members)
    )


def without_tags(model: type[BaseModel], loc: Sequence[str | int]) -> tuple[str | int, ...]:
    """`loc` without the tags a discriminated union inserts (`prepare[0].upload.src` -> `prepare[0].src`):
    the path as the user wrote it."""
    out: list[str | int] = []
    annotation: object = model
    for step in loc:
        if annotation is None:  # past what the model describes (a dict's keys): kept as is
            out.append(step)
            continue
        if not _is_tag(annotation, step):
            out.append(step)
        annotation = _step(annotation, step)
    return tuple(out)


def annotation_at(model: type[BaseModel], loc: Sequence[str | int]) -> object:
    """The annotation of the value at `loc` in `model` (lists, dicts, unions and tags followed); None when
    `loc` leaves the model."""
    annotation: object = model
    for step in loc:
        annotation = _step(annotation, step)
        if annotation is None:
            return None
    return annotation


def _field_names(annotation: object) -> list[str]:
    return [name for a in _members(annotation) if _is_model(a) for name in a.model_fields]


def _leaf_paths(model: type[BaseModel], prefix: str = "", seen: frozenset[type] = frozenset()) -> list[str]:
    """Dotted paths of the fields reachable through sections (not lists or dicts) of `model`."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        out.append(prefix + name)
        for sub in _members(info.annotation):
            if _is_model(sub) and sub not in seen:
                out += _leaf_paths(sub, f"{prefix}{name}.", seen | {model})
    return out


def close_match(word: str, choices: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The choice `word` most likely meant (`claude-code` -> `claude_code`, `num_sample` -> `num_samples`)."""
    if not choices:
        return None
    for variant in (word, word.replace("-", "_"), word.lower().replace("-", "_")):
        if variant in choices and variant != word:
            return variant
    found = difflib.get_close_matches(word.replace("-", "_"), list(choices), n=1, cutoff=cutoff)
    return found[0] if found else None


def suggest_field(model: type[BaseModel], loc: Sequence[str | int]) -> str | None:
    """What the unknown key at `loc` most likely meant: a field beside it with a close spelling (returned
    as its name), or the same name in another section of `model` (returned as its dotted path)."""
    if not loc or not isinstance(loc[-1], str):
        return None
    name = loc[-1]
    siblings = _field_names(annotation_at(model, loc[:-1]))
    near = close_match(name, siblings)
    if near is not None:
        return near
    elsewhere = [p for p in _leaf_paths(model) if p.rsplit(".", 1)[-1] == name.replace("-", "_")]
    return elsewhere[0] if elsewhere else None


_QUOTED = re.compile(r"'([^']*)'")


def hint(err: ErrorDetails, model: type[BaseModel]) -> str:
    """Pydantic's message for one error, with what the user most likely meant."""
    kind, loc, msg = err["type"], tuple(err["loc"]), str(err["msg"]).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        near = suggest_field(model, loc)
        return f"{msg} (did you mean {near}?)" if near else msg
    if kind in ("literal_error", "enum") and isinstance(err.get("input"), str):
        choices = _QUOTED.findall(str((err.get("ctx") or {}).get("expected", "")))
        near = close_match(err["input"], choices)
        return f"{msg} (did you mean {near!r}?)" if near else msg
    if kind == "union_tag_not_found":
        key = str((err.get("ctx") or {}).get("discriminator", "type")).strip("'")
        tags = sorted({t for a in _members(annotation_at(model, loc)) if _is_model(a) for t in _tags(a)})
        return f"needs `{key}:` ({' or '.join(tags)})" if tags else msg
    return msg


def validation_problem(exc: ValidationError, model: type[BaseModel]) -> tuple[tuple[str | int, ...], str]:
    """The error of `exc` worth naming (a misspelt key also leaves the real one missing: the unknown key is
    the one to report) as (location, message with a hint)."""
    errors = exc.errors(include_url=False)
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    return without_tags(model, err["loc"]), hint(err, model)
