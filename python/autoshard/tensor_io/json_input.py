"""Reading JSON that comes from a file someone else wrote (a checkpoint's manifest, a Hugging
Face index), so that a hostile one is refused with the file and the field named instead of
exhausting memory or the interpreter's stack.

- Size: at most ``MAX_JSON_BYTES`` (100,000,000 bytes, the header limit of the safetensors
  library), checked by the caller before the file is read.
- Nesting: at most ``max_depth`` levels of lists and objects, found by a pre-scan that uses no
  recursion (strings are cut out, then the innermost ``[]``/``{}`` pairs are removed once per
  level, each pass a C-speed regular expression), so ``json.loads`` never meets a document
  deep enough to raise ``RecursionError``.
- Values: at most ``MAX_JSON_VALUES`` (4,000,000) lists, objects and their elements, counted
  by the same pre-scan (each ``[``, ``{`` and ``,`` outside strings) before any Python object
  is built. Within the size limit, ``[[],[],...]`` would otherwise become about 30 million
  lists: gigabytes of memory and tens of seconds of parsing. A manifest of 9,216 pieces holds
  about 100,000; a document just under the limit ([[],[],...] of 2 million lists) parses in
  about 2 s and 160 MB.
- Duplicate keys in any object are refused (``json.loads`` would keep the last one silently).
"""

import json
import re
from typing import Any

MAX_JSON_BYTES = 100_000_000
MAX_JSON_VALUES = 4_000_000

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


class JSONRefusal(ValueError):
    """A JSON document refused: ``field`` says where, ``problem`` what."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


def _structure(data: bytes) -> bytes:
    """The bytes of ``data`` outside its strings."""
    return _STRING.sub(b"", data)


def value_count(data: bytes) -> int:
    """About how many values parsing ``data`` builds: its lists and objects and their elements
    (each ``[``, ``{`` and ``,`` outside strings), counted without parsing."""
    outside = _structure(data)
    return outside.count(b"[") + outside.count(b"{") + outside.count(b",")


def too_deep(data: bytes, max_depth: int) -> bool:
    """Whether ``data`` nests lists and objects more than ``max_depth`` levels deep (for a
    document whose brackets match; one whose do not is left for the parser to refuse)."""
    brackets = _structure(data).translate(None, _NOT_BRACKET)
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets = _INNERMOST.sub(b"", brackets)
    return bool(brackets) and _INNERMOST.search(brackets) is not None


def _unique_pairs(pairs):
    result = dict(pairs)
    if len(result) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONRefusal(f"the key {key!r}", "appears twice in one object (duplicate key)")
            seen.add(key)
    return result


def _deep_field(text: str, max_depth: int) -> str:
    """The top-level field that nests too deeply (the error path only)."""
    decoder = json.JSONDecoder()
    whitespace = re.compile(r"[ \t\n\r]*")
    pos = whitespace.match(text, 0).end()
    if not text.startswith("{", pos):
        return "the document"
    pos += 1
    while True:
        pos = whitespace.match(text, pos).end()
        if not text.startswith('"', pos):
            return "the document"
        try:
            key, pos = json.decoder.scanstring(text, pos + 1, True)
        except ValueError:
            return "the document"
        pos = whitespace.match(text, pos).end()
        if not text.startswith(":", pos):
            return "the document"
        start = whitespace.match(text, pos + 1).end()
        try:
            _, pos = decoder.raw_decode(text, start)
        except RecursionError:
            return repr(key)
        except ValueError:
            return "the document"
        if too_deep(text[start:pos].encode(), max_depth - 1):
            return repr(key)
        pos = whitespace.match(text, pos).end()
        if not text.startswith(",", pos):
            return "the document"
        pos += 1


def loads(data: bytes, max_depth: int, max_values: int = MAX_JSON_VALUES) -> Any:
    """The JSON document in ``data``; raises JSONRefusal (a ValueError) naming the field for one
    nested deeper than ``max_depth`` or holding a duplicate key, and for one of more than
    ``max_values`` values (see value_count); ValueError for one that is no JSON at all."""
    count = value_count(data)
    if count > max_values:
        raise JSONRefusal("the document", f"holds {count} lists, objects and elements, more than the {max_values} "
                                          "a JSON file read by autoshard may hold (MAX_JSON_VALUES)")
    if too_deep(data, max_depth):
        field = _deep_field(data.decode("utf-8", errors="replace"), max_depth)
        raise JSONRefusal(field, f"nests lists and objects more than {max_depth} levels deep")
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_unique_pairs)
    except RecursionError:  # only if max_depth was chosen above the interpreter's limit
        raise JSONRefusal("the document", "nests lists and objects too deeply to parse") from None


def read_file(path: str, max_depth: int, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON document in the file at ``path``, read only if it holds at most ``limit`` bytes."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise JSONRefusal("the file", f"is larger than {limit} bytes, the most this reads")
    return loads(data, max_depth)
