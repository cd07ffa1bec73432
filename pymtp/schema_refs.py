"""A JSON schema's local ``$ref``s in the shape llama.cpp's schema converter resolves.

The converter (llama-cpp-python's ``SchemaConverter``) follows a ref by splitting it on
"/" and looking each piece up as it is: it reads no JSON pointer escapes (``~1`` for "/",
``~0`` for "~"), so a definition named ``a/b`` cannot be reached, nor a property ``x/y``
below one. ``flat_refs`` resolves every local ref here instead, escapes read, and files
what it points at as a definition of its own under a plain name in one ``$defs``, where
the refs then point. Several schemas can share that ``$defs`` (a forced call's functions,
each under its own ``key``), their definitions of one name kept apart.
"""

from __future__ import annotations

import re
from typing import Any

_SECTIONS = ("$defs", "definitions")
MISSING = object()      # what ``pointed`` gives for a pointer to nothing


class RefError(ValueError):
    """A ``$ref`` that cannot be read, and where it is (a JSON pointer into the user's schema)."""

    def __init__(self, message: str, at: str) -> None:
        super().__init__(message)
        self.schema_at = at


def has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(has_ref(v) for v in node.values())
    return isinstance(node, list) and any(has_ref(v) for v in node)


def pointer_step(at: str, key: Any) -> str:
    """The JSON pointer ``at`` one key (or index) deeper, "~" and "/" escaped."""
    return f"{at}/{str(key).replace('~', '~0').replace('/', '~1')}"


def check_refs(node: Any, at: str = "") -> None:
    """Refuse a ``$ref`` that is not a string, naming where (``schema_at``): the
    converter's ref resolution, which runs before anything reads the schema, tripped on
    one with an AttributeError's text."""
    if isinstance(node, dict):
        if "$ref" in node and not isinstance(node["$ref"], str):
            raise RefError(f'$ref must be a string ("#/$defs/Name"), got {node["$ref"]!r}', at)
        for key, value in node.items():
            check_refs(value, pointer_step(at, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            check_refs(value, pointer_step(at, i))


def flat_refs(schema: dict, key: str, defs: dict[str, Any], origins: dict[str, str] | None = None) -> dict:
    """``schema`` with its local refs ("#", "#/...") pointing into ``defs`` as
    ``#/$defs/NAME`` (NAME starting with ``key``, apart from the names ``defs`` holds),
    each target filed there once (a recursive schema refers to itself by name). Its
    own ``$defs``/``definitions`` are left out: what they hold is filed where a ref
    reaches it. A ref to nothing, or outside the schema, is refused (ValueError) with
    its place in the user's schema (the converter's message lacked it and quoted the
    whole schema, its $defs already taken out). A schema
    without refs comes back as it is. ``origins`` gets each NAME's pointer in the
    user's schema ("/$defs/Foo"), for a refusal to name the place the user wrote."""
    if not has_ref(schema):
        return schema
    names: dict[str, str] = {}         # ref -> the name its target is filed under

    def name_for(ref: str) -> str:
        last = ref.rsplit("/", 1)[-1].replace("~1", "/").replace("~0", "~") if ref != "#" else ""
        # the name becomes a grammar rule's, which llama.cpp spells [A-Za-z0-9-]: "a.b" is "a-b"
        last = re.sub(r"[^A-Za-z0-9-]+", "-", last).strip("-") if "/" not in last and "~" not in last else ""
        base = f"{key}-{last}" if last else key
        name, n = base, 1
        while name in defs or name in names.values():
            name, n = f"{base}-{n}", n + 1
        return name

    def point(ref: str, at: str) -> str:
        if ref not in names:
            target = pointed(schema, ref)
            if target is MISSING:
                raise RefError(f"$ref {ref!r} points at nothing in the schema; define its target there "
                               "(under $defs) or correct the name", at)
            names[ref] = name = name_for(ref)
            if origins is not None:
                origins[name] = ref[1:]
            defs[name] = None              # taken before its body refers back to it
            defs[name] = walk(_without_sections(target) if ref == "#" else target, ref[1:])
        return f"#/$defs/{names[ref]}"

    def walk(node: Any, at: str) -> Any:
        if isinstance(node, list):
            return [walk(x, pointer_step(at, i)) for i, x in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v, pointer_step(at, k)) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = point(ref, at)
        elif isinstance(ref, str):      # the converter's refusal named a flag of its own tool (--allow-fetch)
            raise RefError(f"$ref {ref!r} is not in this schema (only refs starting with '#' are read; nothing "
                           "is fetched); copy its target under $defs and refer to it as '#/$defs/Name'", at)
        return out

    return walk(_without_sections(schema), "")



def user_pointer(at: str, origins: dict[str, str]) -> str:
    """The pointer ``at`` into a schema flat_refs made ("/$defs/NAME/...") as the place
    in the user's schema it came from; ``at`` itself where it names no filed target."""
    if not at.startswith("/$defs/"):
        return at
    name, _, rest = at[len("/$defs/"):].partition("/")
    return origins[name] + (f"/{rest}" if rest else "") if name in origins else at


def _without_sections(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if k not in _SECTIONS}


def pointed(root: Any, ref: str) -> Any:
    """What the JSON pointer ``ref`` ("#" or "#/a/b~1c") names in ``root``, or MISSING."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node
