"""Parsing a safetensors header by the format's own grammar, never a general JSON parser.

A header is one JSON object: ``"__metadata__"`` (null, or an object of string -> string) and,
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
from typing import Dict, List, Tuple, Union

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


class HeaderRefusal(ValueError):
    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


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
            raise HeaderRefusal(field, f"is malformed: expected {char!r} at byte {self.pos}, found "
                                       f"{_found(self.text, self.pos)}")
        self.pos += 1

    def string(self, field: str) -> str:
        self.ws()
        if not self.at('"'):
            raise HeaderRefusal(field, f"must be a string, found {_found(self.text, self.pos)} at byte {self.pos}")
        try:
            value, self.pos = json.decoder.scanstring(self.text, self.pos + 1, True)
        except ValueError as error:
            raise HeaderRefusal(field, f"holds a malformed string ({error})") from None
        return value

    def members(self, field: str):
        """Yields each key of the object at the cursor (its value is then read by the caller),
        refusing a key that appears twice."""
        self.expect("{", field)
        self.ws()
        if self.at("}"):
            self.pos += 1
            return
        seen = set()
        while True:
            key = self.string(f"a key of {field}")
            if key in seen:
                raise HeaderRefusal(f"{field}[{key!r}]", "appears twice (duplicate key)")
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
                raise HeaderRefusal(field, f"is malformed: expected ',' or '}}' at byte {self.pos}, found "
                                           f"{_found(self.text, self.pos)}")

    def ints(self, field: str) -> List[int]:
        match = _INTS.match(self.text, self.pos)
        if match is None:
            raise HeaderRefusal(field, f"must be a list of non-negative ints, found {_found(self.text, self.pos)} "
                                       f"at byte {self.pos}")
        self.pos = match.end()
        return [int(n) for n in _DIGITS.findall(match.group())]

    def metadata(self) -> Dict[str, str]:
        field = repr(METADATA)
        if self.text.startswith("null", self.pos):
            self.pos += 4
            return {}
        if not self.at("{"):
            raise HeaderRefusal(field, "must be an object of string -> string (the safetensors format's rule), "
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
            raise HeaderRefusal(field, f"must be an object of dtype, shape and data_offsets, found "
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
                    raise HeaderRefusal(where, f"must be a string, a number or a list of ints, found "
                                               f"{_found(self.text, self.pos)}")
                self.pos = scalar.end()
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise HeaderRefusal(field, f"lacks {missing}")
        if len(entry["data_offsets"]) != 2:
            raise HeaderRefusal(f"{field}['data_offsets']", f"must be [begin, end], got {entry['data_offsets']}")
        return entry


def parse_header(text: str) -> Tuple[Dict[str, Dict[str, Value]], Dict[str, str]]:
    """(tensor name -> {"dtype", "shape", "data_offsets"}, metadata) of a header's text;
    raises HeaderRefusal naming the field."""
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
        raise HeaderRefusal("the header", f"has bytes after its JSON object, at byte {parser.pos}")
    return tensors, metadata
