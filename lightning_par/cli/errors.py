"""A mistake on the ``lightning-par`` command line or in its YAML, said in one line that leads with it.

jsonargparse reports a bad value of a class argument (a strategy's ``tensor_parallel_size``) as a tree: the key of
the union it belongs to (``trainer.strategy``), every subtype it tried (``Expected a <class 'str'>``), the class
path, the argument, and the whole namespace given. :func:`explain` keeps the path of keys and the reason, and adds
what would fit: the choices of a ``Literal``, the closest name of a misspelt argument or option. No lightning import:
the text is parsed as jsonargparse writes it, and classes are looked up by their import path.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from typing import Iterable

__all__ = ["CommandLineError", "explain", "closest"]

_KEY = re.compile(r'^Parser key "([^"]+)":$')
_CLASS_PATH = re.compile(r"^Problem with given class_path '([^']+)':$")
_NOT_ACCEPTED = re.compile(r"^Option '([^']+)' is not accepted$")
_EXPECTED = re.compile(r"^Expected a (.+?)(?:\. Got value: (.*))?$")
_GIVEN = re.compile(r"^Given value: (.*)$")
_UNRECOGNIZED = re.compile(r"^unrecognized arguments: (.+)$")
# What jsonargparse says of the union's other members and of the value given: never the user's mistake.
_NOISE = re.compile(r"^(Does not validate against any of the Union subtypes|Subtypes: .*|Errors:|"
                    r"Expected a <class '(str|NoneType)'>.*|Given value type: .*|Given value: .*)$")


class CommandLineError(Exception):
    """A command line or config the parser refused, with jsonargparse's message (see :func:`explain`)."""

    def __init__(self, message: str, options: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.options = list(options)  # the parser's option strings, to suggest from

    def __str__(self) -> str:
        return explain(self.args[0], self.options)


def closest(name: str, names: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``names`` to ``name`` (case aside), or ``""``."""
    names = list(names)
    by_lower = {candidate.lower(): candidate for candidate in names}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[match[0]]!r}?" if match else ""


def explain(message: str, options: Iterable[str] = ()) -> str:
    """jsonargparse's ``message`` as one line: the key the user wrote, the value, the reason and what would fit.
    ``options``: the parser's option strings, for an option it did not recognise."""
    keys: list[str] = []
    class_path = None
    reasons = []
    given_values = []  # what jsonargparse says was given, innermost first
    for line in message.splitlines():
        line = line.strip().removeprefix("- ").strip()
        if given := _GIVEN.match(line):
            given_values.append(given.group(1))
        if not line or _NOISE.match(line):
            continue
        if key := _KEY.match(line):
            keys.append(key.group(1))
        elif path := _CLASS_PATH.match(line):
            class_path = path.group(1)
            keys.append("init_args")
        else:
            reasons.append(line)
    if not reasons:
        return message.strip().splitlines()[0] if message.strip() else message
    reason, where = reasons[0], ".".join(keys)
    if unrecognized := _UNRECOGNIZED.match(reason):
        given = unrecognized.group(1).split()[0]
        return f"{given}: no such option{closest(given.split('=')[0], options)}"
    if not_accepted := _NOT_ACCEPTED.match(reason):
        name = not_accepted.group(1)
        return (f"--{where}.{name}: {_short(class_path)} has no argument {name!r}"
                f"{closest(name, _arguments(class_path))}")
    if expected := _EXPECTED.match(reason):
        wanted, given = expected.groups()
        if given is None:  # an Optional[...]: the value is in the "Given value" line of its own report
            given = given_values[0] if given_values else "?"
        choices = re.findall(r"'([^']*)'", wanted) if "Literal" in wanted else []
        if choices:
            return (f"--{where}={given}: not one of {', '.join(map(repr, choices))}"
                    f"{closest(given, choices)}")
        return f"--{where}={given}: expected {_type_name(wanted)}"
    # A class refused its arguments (the strategies' own checks name the argument, the value and what fits).
    return f"{where}" + (f" ({_short(class_path)})" if class_path else "") + f": {reason}" if where else reason


def _short(class_path: str | None) -> str:
    return class_path.rsplit(".", 1)[-1] if class_path else "the class"


def _type_name(wanted: str) -> str:
    found = re.fullmatch(r"<class '([^']+)'>", wanted)
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}.get(
        found.group(1), found.group(1)) if found else wanted


def _arguments(class_path: str | None) -> list[str]:
    """The names of ``class_path``'s constructor arguments (its own and those it passes on), or [] if it cannot be
    imported."""
    if not class_path or "." not in class_path:
        return []
    module, name = class_path.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return []
    names: list[str] = []
    for klass in getattr(cls, "__mro__", [cls]):
        init = vars(klass).get("__init__")
        if init is not None:
            names += [p for p in inspect.signature(init).parameters if p not in ("self", "args", "kwargs")]
    return list(dict.fromkeys(names))
