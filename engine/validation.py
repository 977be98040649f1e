"""One validation layer for data that crosses a boundary: pydantic types, errors naming the field.

Configs, sampling parameters and client requests are pydantic models (or frozen pydantic
dataclasses) built from the types here. ``field_errors`` turns pydantic's errors into
one line per problem: the field as a dotted path (``messages.0.role``, OpenAI's ``param``)
and what is allowed (``messages.0.role must be 'system', 'user', ..., got 'wizard'``).
"""

from __future__ import annotations

import functools
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable

import annotated_types
import pydantic
from pydantic import AfterValidator, AllowInfNan, Strict, Tag, ValidationError

# Strict scalars: "8" is not an int, True is not a number, 16.0 is not a block size.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]
"""A finite number; ints are accepted."""
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid UTF-8 text (unpaired surrogate at character {exc.start})") from None
    return text


Text = Annotated[str, Strict(), AfterValidator(_utf8)]
"""A str that can be encoded: JSON (and Python) allow lone surrogates, tokenizers and clients do not."""

_SHOULD = re.compile(r"^(Input|String|List|Tuple|Dictionary|Value) should ")
_MAX_INPUT_CHARS = 80


@dataclass(frozen=True)
class FieldError:
    param: str | None
    """The field as a dotted path (``stop.1``); None when the problem spans fields."""
    message: str


def field_errors(exc: ValidationError, model: type | None = None) -> list[FieldError]:
    """One ``FieldError`` per problem. ``model`` (the validated class) adds the allowed field
    names to "unknown field" errors, descriptions to "required" ones, and hides the values of
    fields declared with ``repr=False``."""
    errors = exc.errors(include_url=False)
    # pydantic counts a list's items after dropping the bad ones: "too short" then only repeats them
    parents = {tuple(e["loc"][:i]) for e in errors for i, part in enumerate(e["loc"]) if isinstance(part, int)}
    return [_field_error(err, model) for err in errors
            if not (err["type"] in ("too_short", "too_long") and tuple(err["loc"]) in parents)]


def union_tag(name: str) -> Tag:
    """A tagged union member's tag, which pydantic puts in an error's location: marked, so that the
    field path named to the client leaves it out (``input.0.type``, not ``input.0.message.type``)."""
    return Tag(_TAG_MARK + name)


_TAG_MARK = "\x00"


def _field_error(err: dict, model: type | None) -> FieldError:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(_TAG_MARK)))
    key = loc[-1:] == ("[key]",)  # a mapping's key, not its value (pydantic's own marker)
    loc = loc[:-1] if key else loc
    param = ".".join(str(part) for part in loc) or None
    kind, msg = err["type"], err["msg"]
    if key:
        msg = "key " + _SHOULD.sub("must ", msg)
    fields, info, hidden = _lookup(model, loc)
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        allowed = f"; allowed: {', '.join(fields)}" if fields else ""
        return FieldError(param, f"unknown field {param}{allowed}")
    if kind in ("missing", "missing_argument"):
        hint = f": {info.description}" if info is not None and info.description else ""
        return FieldError(param, f"{param} is required{hint}")
    shown = repr(err.get("input"))
    if kind == "string_unicode":
        msg, shown = "must be valid UTF-8 text (it holds an unpaired surrogate)", None
    elif kind in ("too_long", "too_short"):
        ctx = err["ctx"]
        n = ctx["max_length"] if kind == "too_long" else ctx["min_length"]
        bound = "at most" if kind == "too_long" else "at least"
        unit = "character" if isinstance(err.get("input"), str) else "item"
        msg, shown = f"must have {bound} {n} {unit}{'s' if n != 1 else ''}", f"{ctx['actual_length']}"
        if kind == "too_short" and n == 1:
            msg, shown = "must not be empty", None
    elif kind == "tuple_type":
        msg = "must be a list"
    elif kind in ("value_error", "assertion_error"):
        msg = msg.split(", ", 1)[1] if msg.startswith(("Value error, ", "Assertion failed, ")) else msg
    elif isinstance(loc[-1:] and loc[-1], str) and (allowed := _numeric_range(info)):
        msg = f"must be {allowed}"  # the whole range, whichever bound (or type) was missed
    else:
        msg = _SHOULD.sub("must ", msg)
    if param is None:
        return FieldError(None, msg)
    text = f"{param} {msg}" if msg.startswith(("must ", "is ", "has ", "key ")) else f"{param}: {msg}"
    if not hidden and "input" in err and shown is not None and ", got " not in msg:
        text += f", got {shown if len(shown) <= _MAX_INPUT_CHARS else shown[:_MAX_INPUT_CHARS] + '...'}"
    return FieldError(param, text)


def _lookup(model: type | None, loc: tuple) -> tuple[list[str], Any, bool]:
    """(field names of the model holding loc's last part, that part's FieldInfo, whether
    some field on the way hides its value)."""
    info, hidden = None, False
    for i, part in enumerate(loc):
        fields = getattr(model, "__pydantic_fields__", None) or {}
        if isinstance(part, int):
            continue  # an item of a list: its model is already current
        if part not in fields:
            return list(fields) if i == len(loc) - 1 else [], None, hidden
        info = fields[part]
        hidden = hidden or not info.repr
        if i < len(loc) - 1:
            model = _inner_model(info.annotation)
    return [], info, hidden


def _numeric_range(info: Any) -> str | None:
    """'an integer in [1, 4096]', 'a number > 0': a numeric field's bounds, if it has any."""
    if info is None:
        return None
    low = high = None
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            low = (m.ge, "[")
        elif isinstance(m, annotated_types.Gt):
            low = (m.gt, "(")
        elif isinstance(m, annotated_types.Le):
            high = (m.le, "]")
        elif isinstance(m, annotated_types.Lt):
            high = (m.lt, ")")
    if low is None and high is None:
        return None
    kind = "an integer" if _scalar(info.annotation) is int else "a number"  # NaN and inf are not numbers here
    if low and high:
        return f"{kind} in {low[1]}{low[0]}, {high[0]}{high[1]}"
    if low:
        return f"{kind} {'>=' if low[1] == '[' else '>'} {low[0]}"
    return f"{kind} {'<=' if high[1] == ']' else '<'} {high[0]}"


def _scalar(annotation: Any) -> type | None:
    if annotation in (int, float):
        return annotation
    for arg in typing.get_args(annotation):
        found = _scalar(arg)
        if found is not None:
            return found
    return None


def _inner_model(annotation: Any) -> type | None:
    if hasattr(annotation, "__pydantic_fields__"):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def validated(error: type[Exception] | Callable[[list[FieldError]], Exception] = ValueError,
              extra: str = "forbid"):
    """A frozen pydantic dataclass whose bad input raises ``error`` naming the field.

    ``error``: an exception class (given every problem in one message) or a function of
    the ``FieldError`` list. ``extra``: what unknown fields do (pydantic's ``extra``). It
    stays a dataclass (``dataclasses.fields``, ``replace``, which validates again,
    positional arguments, ``FrozenInstanceError``); field docstrings are its descriptions.
    """
    def wrap(cls: type) -> type:
        cls = pydantic.dataclasses.dataclass(
            frozen=True, config=pydantic.ConfigDict(extra=extra, use_attribute_docstrings=True))(cls)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as exc:
                errors = field_errors(exc, cls)
                if isinstance(error, type) and issubclass(error, Exception):
                    raise error("; ".join(e.message for e in errors)) from None
                raise error(errors) from None

        cls.__init__ = __init__
        return cls
    return wrap
