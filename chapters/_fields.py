"""Config dataclasses: type checks with one-line errors, and field docs that help() shows.

Every chapter's config is a dataclass whose fields carry a one-line docstring under them
(the house style). Python drops those strings, so `help(OptimizerConfig)` and IDE hovers
would show nothing: `document_fields` copies them into the class docstring. `check_fields`
rejects a value whose type does not match the annotation (`lr="3e-4"`, `tie_embeddings="no"`,
`sequence_length=32.0`) with a `ValueError` that names the class, the field and the value,
before a wrong type can travel thirteen frames deep or, worse, be accepted.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import numbers
import textwrap
import types
import typing

__all__ = ["document_fields", "check_fields", "check_range", "check_choice"]


def _field_docs(cls) -> dict[str, str]:
    """{field: the string literal right under its annotation} read from the class source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # defined in a notebook cell or an interactive session
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def document_fields(cls):
    """Class decorator: append every field's name, type, default and docstring to __doc__."""
    docs = {}
    for klass in reversed(cls.__mro__):  # a dataclass base's fields are documented in its source
        if dataclasses.is_dataclass(klass):
            docs.update(_field_docs(klass))
    if not docs:
        return cls
    lines = []
    for f in dataclasses.fields(cls):
        if f.name not in docs or not f.init:
            continue
        default = ("" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   else f" = {f.default!r}" if f.default is not dataclasses.MISSING else " = (factory)")
        lines.append(f"    {f.name}: {f.type}{default}\n        {docs[f.name]}")
    cls.__doc__ = f"{(cls.__doc__ or '').strip()}\n\nFields:\n" + "\n".join(lines) + "\n"
    cls.__field_docs__ = docs
    return cls


_HINTS: dict = {}


def _hints(cls) -> dict:
    """Resolved field annotations, cached per class."""
    if cls not in _HINTS:
        try:
            _HINTS[cls] = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an unresolvable annotation is simply not checked
            _HINTS[cls] = {}
    return _HINTS[cls]


def _accepts(kind, value) -> bool | None:
    """Whether value fits one plain annotation; None when the annotation is not checked here."""
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool) or type(value).__name__ == "bool_"
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    return None


_NAMES = {bool: "a bool (True/False)", int: "an int", float: "a number", str: "a string",
          type(None): "None"}


def _check_one(owner: str, name: str, hint, value) -> None:
    """ValueError unless value fits hint (a plain type, or a union of plain types)."""
    options = (typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType)
               else (hint,))
    verdicts = [_accepts(k, value) for k in options]
    if any(v is None for v in verdicts) or any(verdicts):
        return  # a container or class annotation: left to the config's own checks
    wanted = " or ".join(_NAMES.get(k, getattr(k, "__name__", str(k))) for k in options)
    raise ValueError(f"{owner}.{name} must be {wanted}, got {value!r} "
                     f"({type(value).__name__})")


def check_fields(obj) -> None:
    """ValueError naming the first field whose value does not match its annotation."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name in hints:
            _check_one(type(obj).__name__, f.name, hints[f.name], getattr(obj, f.name))


def check_range(obj, name: str, low=None, high=None, *, low_open: bool = False,
                high_open: bool = False) -> None:
    """ValueError naming the field when its (non-None) value lies outside [low, high]."""
    value = getattr(obj, name)
    if value is None:
        return
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        where = (f"in {lo}, {hi}" if low is not None and high is not None
                 else f"{'>' if low_open else '>='} {low}" if low is not None
                 else f"{'<' if high_open else '<='} {high}")
        raise ValueError(f"{type(obj).__name__}.{name} must be {where}, got {value!r}")


def check_choice(obj, name: str, choices) -> None:
    """ValueError naming the field when its value is not one of choices."""
    value = getattr(obj, name)
    if value not in choices:
        raise ValueError(f"{type(obj).__name__}.{name} must be one of {list(choices)}, "
                         f"got {value!r}")
