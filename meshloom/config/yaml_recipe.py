"""YAML recipes read as a person wrote them.

PyYAML follows YAML 1.1, whose implicit types surprise: `steps: 1:30` is 90 (base 60), `grouped_mm: off` is
False, `seed: 012` is 10 (octal). The loader here keeps YAML 1.2's core types instead: booleans are only
true/false, integers are decimal (or 0x hex), floats have no base-60 form. Anything else stays the string it
looks like, so a string setting gets it as written, and a number or switch setting names it in one line.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_BOOL, _INT, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class PlainLoader(yaml.SafeLoader):
    """SafeLoader (plain dicts, lists and scalars only) with YAML 1.2 core scalars."""


PlainLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
PlainLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
PlainLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$"), list("-+0123456789")
)
PlainLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
        r"|\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)

# YAML 1.1's other spellings of true and false.
_OLD_BOOLEANS = {"yes", "no", "on", "off", "y", "n"}
_BASE_60 = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")


def load(text: str) -> Any:
    return yaml.load(text, Loader=PlainLoader)  # noqa: S506 - PlainLoader is a SafeLoader


def misread_hint(value: Any, wanted: type) -> str:
    """Why a YAML string that YAML 1.1 would have read as a bool or a number is not one here, or "" if it is not such a
    string: the refusal appends it."""
    if not isinstance(value, str):
        return ""
    if wanted is bool and value.lower() in _OLD_BOOLEANS:
        return f"; YAML 1.1 would read {value!r} as a switch, YAML 1.2 as text: write true or false"
    if wanted in (int, float) and _BASE_60.match(value):
        return f"; YAML 1.1 would read {value!r} as a base-60 number: write the number itself, or quote a time as text"
    return ""
