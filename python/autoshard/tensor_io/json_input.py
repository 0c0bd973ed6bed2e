"""Reading JSON that comes from a file someone else wrote (a checkpoint's manifest, a Hugging
Face index, a safetensors header), so that a hostile one is refused with the file and the field named instead of
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

A safetensors header is parsed by the format's own grammar (``parse_header``), never a general
JSON parser. A header is one JSON object: ``"__metadata__"`` (null, or an object of string -> string) and,
for every tensor, an object of ``dtype`` (a string), ``shape`` and ``data_offsets`` (lists of
non-negative ints). Nothing in it nests deeper than that, so this parser has no recursion and
builds nothing but those strings and ints: a header that nests (``[[[[...``), or whose metadata
is anything else (``[[],[],...]``, which ``json.loads`` would turn into tens of millions of
lists) is refused at its first byte that breaks the grammar, and a key that appears twice is
refused (``json.loads`` keeps the last one; the safetensors library refuses both). Unknown
fields of a tensor, which the safetensors library ignores, may hold only scalars or lists of ints.
"""

import json
import re
from typing import Any, Dict, List, Tuple, Union

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


def value_count(data: bytes) -> int:
    """About how many values parsing ``data`` builds: its lists and objects and their elements
    (each ``[``, ``{`` and ``,`` outside strings), counted without parsing."""
    outside = _STRING.sub(b"", data)  # the bytes outside strings
    return outside.count(b"[") + outside.count(b"{") + outside.count(b",")


def too_deep(data: bytes, max_depth: int) -> bool:
    """Whether ``data`` nests lists and objects more than ``max_depth`` levels deep (for a
    document whose brackets match; one whose do not is left for the parser to refuse)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKET)
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
    parser = _Parser(text)
    try:
        for key in parser.members("the document", unique=False):
            start = parser.pos
            _, parser.pos = json.JSONDecoder().raw_decode(text, start)
            if too_deep(text[start:parser.pos].encode(), max_depth - 1):
                return repr(key)
    except RecursionError:
        return repr(key)
    except ValueError:  # malformed where the parser stands: the parser of loads names it
        pass
    return "the document"


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


METADATA = "__metadata__"

_WS = re.compile(r"[ \t\n\r]*")
_UINT = r"(?:0|[1-9][0-9]{0,19})"
_INTS = re.compile(r"\[[ \t\n\r]*(?:%s[ \t\n\r]*(?:,[ \t\n\r]*%s[ \t\n\r]*)*)?\]" % (_UINT, _UINT))
_DIGITS = re.compile(r"[0-9]+")
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
# The layout every writer we know produces, parsed in one match.
_ENTRY = re.compile(r'\{"dtype":"([A-Za-z0-9_]{1,32})","shape":(\[(?:%s(?:,%s)*)?\]),"data_offsets":\[(%s),(%s)\]\}'
                    % (_UINT, _UINT, _UINT, _UINT))

Value = Union[str, List[int]]


def _found(text: str, pos: int) -> str:
    if pos >= len(text):
        return "the end of the header"
    return {"[": "a list", "{": "an object", '"': "a string"}.get(text[pos], f"{text[pos:pos + 12]!r}")


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def ws(self) -> None:
        self.pos = _WS.match(self.text, self.pos).end()

    def at(self, char: str) -> bool:
        return self.text.startswith(char, self.pos)

    def expect(self, char: str, field: str) -> None:
        self.ws()
        if not self.at(char):
            raise JSONRefusal(field, f"is malformed: expected {char!r} at byte {self.pos}, found "
                                       f"{_found(self.text, self.pos)}")
        self.pos += 1

    def string(self, field: str) -> str:
        self.ws()
        if not self.at('"'):
            raise JSONRefusal(field, f"must be a string, found {_found(self.text, self.pos)} at byte {self.pos}")
        try:
            value, self.pos = json.decoder.scanstring(self.text, self.pos + 1, True)
        except ValueError as error:
            raise JSONRefusal(field, f"holds a malformed string ({error})") from None
        return value

    def members(self, field: str, unique: bool = True):
        """Yields each key of the object at the cursor (its value is then read by the caller),
        refusing a key that appears twice if ``unique``."""
        self.expect("{", field)
        self.ws()
        if self.at("}"):
            self.pos += 1
            return
        seen = set()
        while True:
            key = self.string(f"a key of {field}")
            if unique and key in seen:
                raise JSONRefusal(f"{field}[{key!r}]", "appears twice (duplicate key)")
            seen.add(key)
            self.expect(":", f"{field}[{key!r}]")
            self.ws()
            yield key
            self.ws()
            if self.at(","):
                self.pos += 1
            elif self.at("}"):
                self.pos += 1
                return
            else:
                raise JSONRefusal(field, f"is malformed: expected ',' or '}}' at byte {self.pos}, found "
                                           f"{_found(self.text, self.pos)}")

    def ints(self, field: str) -> List[int]:
        match = _INTS.match(self.text, self.pos)
        if match is None:
            raise JSONRefusal(field, f"must be a list of non-negative ints, found {_found(self.text, self.pos)} "
                                       f"at byte {self.pos}")
        self.pos = match.end()
        return [int(n) for n in _DIGITS.findall(match.group())]

    def metadata(self) -> Dict[str, str]:
        field = repr(METADATA)
        if self.text.startswith("null", self.pos):
            self.pos += 4
            return {}
        if not self.at("{"):
            raise JSONRefusal(field, "must be an object of string -> string (the safetensors format's rule), "
                                       f"found {_found(self.text, self.pos)}")
        metadata = {}
        for key in self.members(field):
            metadata[key] = self.string(f"{field}[{key!r}]")
        return metadata

    def entry(self, name: str) -> Dict[str, Value]:
        match = _ENTRY.match(self.text, self.pos)
        if match is not None:
            self.pos = match.end()
            dtype, shape, begin, end = match.groups()
            return {"dtype": dtype, "shape": [int(n) for n in _DIGITS.findall(shape)],
                    "data_offsets": [int(begin), int(end)]}
        field = f"tensor {name!r}"
        if not self.at("{"):
            raise JSONRefusal(field, f"must be an object of dtype, shape and data_offsets, found "
                                       f"{_found(self.text, self.pos)}")
        entry: Dict[str, Value] = {}
        for key in self.members(field):
            where = f"{field}[{key!r}]"
            if key == "dtype":
                entry[key] = self.string(where)
            elif key in ("shape", "data_offsets"):
                entry[key] = self.ints(where)
            elif self.at('"'):
                self.string(where)
            elif self.at("["):
                self.ints(where)
            else:
                scalar = _SCALAR.match(self.text, self.pos)
                if scalar is None:
                    raise JSONRefusal(where, f"must be a string, a number or a list of ints, found "
                                               f"{_found(self.text, self.pos)}")
                self.pos = scalar.end()
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise JSONRefusal(field, f"lacks {missing}")
        if len(entry["data_offsets"]) != 2:
            raise JSONRefusal(f"{field}['data_offsets']", f"must be [begin, end], got {entry['data_offsets']}")
        return entry


def parse_header(text: str) -> Tuple[Dict[str, Dict[str, Value]], Dict[str, str]]:
    """(tensor name -> {"dtype", "shape", "data_offsets"}, metadata) of a header's text;
    raises JSONRefusal naming the field."""
    parser = _Parser(text)
    tensors: Dict[str, Dict[str, Value]] = {}
    metadata: Dict[str, str] = {}
    for key in parser.members("the header"):
        if key == METADATA:
            metadata = parser.metadata()
        else:
            tensors[key] = parser.entry(key)
    parser.ws()
    if parser.pos != len(text):
        raise JSONRefusal("the header", f"has bytes after its JSON object, at byte {parser.pos}")
    return tensors, metadata
