"""A grammar of hostile Pub/Sub messages: hypothesis strategies and a seeded generator.

A ``Case`` is one message (``data``, ``attributes``) and what a worker must make of it:
``RUN`` (its handler runs once) or the ``error_type`` of its one failure record. The same
grammar drives both: every choice goes through a ``Chooser``, which is a seeded
``random.Random`` for ``generate`` (deterministic, no hypothesis) or hypothesis's ``draw`` for
``cases`` (so hypothesis can shrink a failing case).

What it covers: random bytes; invalid UTF-8, overlong encodings, encoded surrogates; a UTF-8
BOM; UTF-16/32 JSON; lone surrogates as ``\\u`` escapes in keys and values; NUL and control
characters; RFC 8259 edge cases (NaN, Infinity, 1e400, -0, integers beyond 4300 digits,
leading zeros, trailing commas, single quotes, comments, duplicate keys, top-level scalars,
arrays and null, empty and whitespace-only bodies, 100k levels of nesting, long strings);
payloads the typed dataclass conversion refuses; missing, empty and unknown jobs; job names and
ids of every shape; up to 100 attributes, keys of 256 and values of 1024 bytes with a multibyte
character at the boundary, forged failure-record attributes, broken trace context; sizes up to
10 MB (over ``max_payload_bytes``: oversize).

Decisions the expectations encode (decode's, documented here): a BOM is not JSON (RFC 8259
lets a parser refuse it); duplicate keys are JSON and the last one wins; a number a float cannot
hold is not JSON; a lone surrogate is a string like any other; the order of checks is
oversize, missing job, unknown job, not JSON, not an object, invalid payload.

Attributes stay what Pub/Sub's publisher accepts: valid UTF-8 (no lone surrogates), at most 100
(less ``Target.reserved_attributes``), keys of 1 to 256 bytes not starting with "goog", values
of at most 1024 bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from hypothesis import strategies as st

from workerpool import constants as c

T = TypeVar("T")

RUN = "run"
MAX_KEY_BYTES = 256
# No generated text contains this word, so a test can look for the framework's tracebacks.
FORBIDDEN_WORD = "traceback"


# -- the targets: what the worker under test has registered ---------------------------------


@dataclass(frozen=True)
class TypedJob:
    """A job whose payload is a dataclass, described by JSON texts (raw, so they may hold
    duplicate keys and escapes): ``valid`` ones convert, ``invalid`` ones are refused, and
    ``failing`` ones convert but the handler fails them with the paired error_type."""

    name: str
    valid: tuple[str, ...]
    invalid: tuple[str, ...]
    failing: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Target:
    dict_job: str  # takes any JSON object
    typed: tuple[TypedJob, ...]
    max_payload_bytes: int
    reserved_attributes: int = 0  # attributes the caller adds to every case (a "case" id)

    @property
    def registered(self) -> frozenset[str]:
        return frozenset({self.dict_job, *(t.name for t in self.typed)})


@dataclass(frozen=True)
class Case:
    kind: str
    data: bytes
    attributes: dict[str, str]
    expected: str | None  # RUN, an error_type, or None: any one outcome will do

    @property
    def triple(self) -> tuple[bytes, dict[str, str], str | None]:
        return self.data, self.attributes, self.expected

    @property
    def job_id(self) -> str | None:
        """The job id a run or record carries; None: the message id stands in."""
        return self.attributes.get(c.ATTR_JOB_ID) or None


# -- choosers: where the grammar's randomness comes from ------------------------------------


class Chooser(Protocol):
    def choice(self, options: Sequence[T]) -> T: ...
    def integer(self, low: int, high: int) -> int: ...
    def rng(self) -> random.Random: ...  # for bulk bytes hypothesis need not shrink


def pick(ch: Chooser, makers: Sequence[Callable[[], T]]) -> T:
    """Call one of ``makers``, as ``ch`` chooses."""
    return ch.choice(makers)()


class RandomChooser:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choice(self, options: Sequence[T]) -> T:
        return options[self._rng.randrange(len(options))]

    def integer(self, low: int, high: int) -> int:
        return self._rng.randint(low, high)

    def rng(self) -> random.Random:
        return random.Random(self._rng.getrandbits(32))


class DrawChooser:
    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
        self._draw = draw

    def choice(self, options: Sequence[T]) -> T:
        return options[self.integer(0, len(options) - 1)]  # shrinks towards the first

    def integer(self, low: int, high: int) -> int:
        value: int = self._draw(st.integers(low, high))
        return value

    def rng(self) -> random.Random:
        return random.Random(self._draw(st.integers(0, 2**32 - 1)))


# -- bodies ---------------------------------------------------------------------------------

DEEP = 100_000  # levels of nesting: far beyond any parser's recursion limit
SHALLOW = 200  # levels every parser takes, wherever on the stack it is called

NOT_JSON: tuple[bytes, ...] = (
    b"",
    b" ",
    b" \t\r\n ",
    b"\x0b{}",  # vertical tab and form feed are not JSON whitespace
    b"{}\x0c",
    "\u00a0{}".encode(),
    "{}\u2028".encode(),
    b"\x00",
    b"{}\x00",
    b"{} {}",
    b"{}x",
    b"{",
    b"}",
    b"[",
    b'{"a":',
    b'{"a": "unterminated}',
    b"NaN",
    b'{"a": NaN}',
    b'{"a": Infinity}',
    b'{"a": -Infinity}',
    b'{"a": [1, NaN]}',
    b'{"a": nan}',
    b'{"a": inf}',
    b'{"a": 1e400}',
    b'{"a": -1e400}',
    b'{"a": 1E+999}',
    b'{"a": 2e308}',
    b'{"a": 1' + b"0" * 400 + b".5}",
    b'{"a": ' + b"9" * 4301 + b"}",
    b'{"a": -' + b"1" * 5000 + b"}",
    b'{"a": 01}',
    b'{"a": -01}',
    b'{"a": 00}',
    b'{"a": +1}',
    b'{"a": .5}',
    b'{"a": 1.}',
    b'{"a": 0x10}',
    b'{"a": 1e}',
    b'{"a": -}',
    b'{"a": 1_000}',
    b'{"a": 1,}',
    b'{"a": [1,]}',
    b"{,}",
    b"{'a': 1}",
    b"{\"a\": 'b'}",
    b"{a: 1}",
    b'{"a": 1 // comment\n}',
    b'{"a": /* comment */ 1}',
    b"# comment\n{}",
    b'{"a": "\x00"}',  # raw control characters inside a string
    b'{"a": "\x1f"}',
    b'{"a": "line\nbreak"}',
    b'{"a": "\t"}',
    b'{"a": "\\x41"}',
    b'{"a": "\\u12"}',
    b'{"a": "\\U0001F600"}',
    b'{"a": "\\\'"}',
    b'{"a" 1}',
    b'{"a":: 1}',
    b'{"a": 1 "b": 2}',
    b'{"a": True}',
    b'{"a": None}',
    b'{"a": undefined}',
    b'{"a": tru}',
    b"\xef\xbb\xbf{}",  # a UTF-8 BOM
    b"\xff",
    b"\xc3\x28",
    b"\xa0\xa1",
    b'{"a": "\xe2\x82"}',  # truncated sequence
    b"\xc1\xbb}",  # overlong "{"
    b"\xe0\x81\xbb}",
    b"\xf0\x80\x81\xbb}",
    b'{"a": "\xc0\x80"}',  # overlong NUL (modified UTF-8)
    b'{"a": "\xc0\xaf"}',
    b'{"a": "\xed\xa0\x80"}',  # an encoded surrogate (CESU-8)
    b'{"a": "\xed\xa0\xbd\xed\xb8\x80"}',
    b'{"a": "\xf4\x90\x80\x80"}',  # beyond U+10FFFF
    b'{"a": "\xf8\x88\x80\x80\x80"}',
    b"\xfe\xff",
)

NOT_OBJECT: tuple[bytes, ...] = (
    b"0",
    b"-0",
    b"1",
    b"-1.5e10",
    b"1e-400",
    b"9" * 4300,
    b'"s"',
    b'""',
    b'"\\ud800"',
    '"é😀"'.encode(),
    b"true",
    b"false",
    b"null",
    b" null ",
    b"[]",
    b"[{}]",
    b'[{"job": "x"}]',
    b" \n[1, 2]\t\r",
    b"[" * SHALLOW + b"]" * SHALLOW,
)

OBJECTS: tuple[str, ...] = (
    "{}",
    ' \t\n\r{ \t"a" \n:\r 1 , "b":[ ] }\n',
    '{"": ""}',
    '{"\\ud800": 1}',
    '{"a": "\\udfff"}',
    '{"\\udbff\\udbff": "\\udc00\\ud800", "\\ud800\\u0041": 0}',
    '{"\\u0000": "\\u0000", "a": "\\u0000\\u001f\\u007f"}',
    '{"a": -0, "b": -0.0, "c": 0e0, "d": 0E-0}',
    '{"a": 1e-400, "b": 5e-324, "c": 1.7976931348623157e308, "d": -1.7976931348623157e308}',
    '{"a": ' + "9" * 4300 + ', "b": -' + "9" * 4300 + "}",
    '{"a": 1, "a": 2}',
    '{"a": {"a": {}}, "a": [], "a": null}',
    '{"é": "ü", "日本": "😀", "\\ud83d\\ude00": 1, "\\u00e9": 2}',
    '{"a": "\x7f\u2028\u2029\ufeff"}',  # raw DEL, separators and a BOM inside a string
    '{"__proto__": {}, "constructor": 1, "toString": null}',
    '{"job": "nope", "job_id": "", "error_type": "forged"}',
    '{"a": ' + "[" * SHALLOW + "]" * SHALLOW + "}",
    '{"a":' * SHALLOW + "1" + "}" * SHALLOW,
    "{" + ", ".join(f'"k{i}": {i}' for i in range(1000)) + "}",
    '{"a": "' + "x" * 10_000 + '"}',
    '{"a": "' + "\\u00e9" * 1000 + '", "b": "' + "é" * 1000 + '"}',
)

DEEP_NOT_JSON: tuple[bytes, ...] = (
    b"[" * DEEP + b"]" * DEEP,
    b'{"":' * DEEP + b"0" + b"}" * DEEP,
    b'[{"":' * (DEEP // 2) + b"0" + b"}]" * (DEEP // 2),
    b'{"a": ' + b"[" * DEEP,
)


def _u_escape(char: str) -> str:
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def escape_strings(text: str, ch: Chooser) -> str:
    """``text`` with characters inside its string literals written as ``\\u`` escapes (ASCII
    letters, or every non-ASCII character as surrogate pairs beyond the BMP): the same JSON."""
    how = ch.choice(("letters", "non-ascii", "both"))
    out: list[str] = []
    i, in_string = 0, False
    while i < len(text):
        char = text[i]
        if not in_string or char == '"':
            in_string = in_string != (char == '"')
            out.append(char)
        elif char == "\\":  # an escape already: copied as it is
            width = 6 if text[i + 1] == "u" else 2
            out.append(text[i : i + width])
            i += width - 1
        elif (ord(char) > 127 and how != "letters") or (char.isalpha() and how != "non-ascii"):
            out.append(_u_escape(char))
        else:
            out.append(char)
        i += 1
    return "".join(out)


def same_json(text: str, ch: Chooser) -> bytes:
    """``text`` in another spelling of the same JSON: padded, escaped, or as it is."""
    how = ch.choice(("as-is", "padded", "escaped"))
    if how == "padded":
        pad = "".join(ch.choice(" \t\r\n") for _ in range(ch.integer(1, 8)))
        text = pad + text + pad[::-1]
    elif how == "escaped" and len(text) < 5000:
        text = escape_strings(text, ch)
    return text.encode()


def broken_json(text: str, ch: Chooser) -> bytes:
    """``text`` (a JSON object) made not JSON: wrong encoding, a BOM, cut, bad whitespace..."""
    text = text.strip() if text.strip().startswith("{") else "{}"
    how = ch.choice(
        ("bom", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be",
         "latin-1", "overlong", "cut", "nul", "nbsp", "vt", "trailing-comma", "garbage")
    )  # fmt: skip
    if how == "bom":
        return b"\xef\xbb\xbf" + text.encode()
    if how.startswith("utf-"):
        return text.encode(how)
    if how == "latin-1":
        return ('{"é": "ü",' + text[1:]).encode("latin-1", "replace")
    if how == "overlong":
        return text.encode().replace(b"{", ch.choice((b"\xc1\xbb", b"\xe0\x81\xbb")), 1)
    if how == "cut":
        return text.encode()[: ch.integer(0, len(text.encode()) - 1)]
    if how == "trailing-comma":
        return (text[:-1] + ",}").encode() if text != "{}" else b"{,}"
    suffix = {"nul": "\x00", "nbsp": "\u00a0", "vt": "\x0b", "garbage": "x"}[how]
    return (text + suffix).encode()


@dataclass(frozen=True)
class Body:
    data: bytes
    expected: str  # if the job is registered and the size allowed


def body_for(ch: Chooser, target: Target, job: str, *, small: int) -> Body:
    """A hostile body for ``job`` (the dict job or one of the typed ones), under ``small``
    bytes."""
    typed = next((t for t in target.typed if t.name == job), None)
    valid = typed.valid if typed else OBJECTS
    families = ["not-json", "broken", "not-object", "valid", "random-bytes"]
    families += ["invalid", "invalid", "failing"] if typed else ["valid", "soup"]
    family = ch.choice(families)
    if family == "failing" and typed and typed.failing:
        text, error_type = ch.choice(typed.failing)
        return Body(same_json(text, ch), error_type)
    if family in ("invalid", "failing") and typed:
        return Body(same_json(ch.choice(typed.invalid), ch), c.ERR_INVALID_PAYLOAD)
    if family == "not-json":
        return Body(ch.choice(NOT_JSON), c.ERR_NOT_JSON)
    if family == "broken":
        return Body(broken_json(ch.choice(valid), ch), c.ERR_NOT_JSON)
    if family == "not-object":
        return Body(ch.choice(NOT_OBJECT), c.ERR_NOT_OBJECT)
    if family == "random-bytes":
        # A first byte no JSON text starts with: UTF-8 continuation bytes, or "x".
        first = bytes([ch.choice((0x80, 0xBF, 0xC0, 0xF5, 0xFF, ord("x")))])
        return Body(first + ch.rng().randbytes(ch.integer(0, min(small, 2048))), c.ERR_NOT_JSON)
    if family == "soup":
        return Body(json.dumps(soup(ch)).encode(), RUN)
    return Body(same_json(ch.choice(valid), ch), RUN)


def soup(ch: Chooser, depth: int = 0) -> dict[str, Any]:
    """A random JSON object: keys and strings with lone surrogates, NUL, every plane."""
    rng = ch.rng()
    out: dict[str, Any] = {}
    for _ in range(rng.randint(0, 6)):
        kind = rng.choice(("str", "int", "float", "bool", "null", "list", "obj"))
        makers: dict[str, Callable[[], Any]] = {
            "str": lambda: random_text(rng, rng.randint(0, 40), surrogates=True),
            "int": lambda: rng.choice((0, -1, 2**63, -(2**64), 10**300)),
            "float": lambda: rng.choice((-0.0, 0.5, 1e308, 5e-324, -1.5e-300)),
            "bool": lambda: rng.random() < 0.5,
            "null": lambda: None,
            "list": lambda: [rng.randint(-9, 9) for _ in range(rng.randint(0, 5))],
            "obj": lambda: soup(RandomChooser(rng), depth + 1) if depth < 3 else {},
        }
        out[random_text(rng, rng.randint(0, 12), surrogates=True)] = makers[kind]()
    return out


# -- text -----------------------------------------------------------------------------------

_RANGES = (
    (0x20, 0x7E), (0x00, 0x1F), (0x7F, 0x9F), (0xA0, 0x2FF), (0x300, 0x36F),  # combining
    (0x590, 0x6FF), (0x200B, 0x200F), (0x2028, 0x202E), (0x3000, 0x30FF), (0x4E00, 0x4FFF),
    (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFF0, 0xFFFF), (0x1F300, 0x1F6FF), (0xE0000, 0xE007F),
    (0x10FFF0, 0x10FFFF),
)  # fmt: skip


def _pool(ranges: tuple[tuple[int, int], ...], size: int = 50_000) -> str:
    rng = random.Random(0)
    text = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(size))
    return text.replace("raceback", "race-back").replace("RACEBACK", "RACE-BACK")


_TEXT = _pool(_RANGES)
_TEXT_WITH_SURROGATES = _pool((*_RANGES, (0xD800, 0xDFFF)))


def random_text(rng: random.Random, length: int, *, surrogates: bool = False) -> str:
    """``length`` characters from every plane, control characters and combining marks
    included (and lone surrogates, if asked), at most 40,000."""
    pool = _TEXT_WITH_SURROGATES if surrogates else _TEXT
    start = rng.randrange(len(pool) - length)
    return pool[start : start + length]


def fill_utf8(prefix: str, size: int, char: str) -> str:
    """``prefix`` padded to exactly ``size`` UTF-8 bytes, ending in whole ``char``s (so a
    multibyte character sits right at the boundary)."""
    room = size - len(prefix.encode())
    width = len(char.encode())
    return prefix + "a" * (room % width) + char * (room // width)


def cut_utf8(text: str, size: int) -> str:
    return text.encode()[:size].decode("utf-8", "ignore")


def shapes(ch: Chooser, token: str, size: int) -> str:
    """A string of some hostile shape that contains ``token`` (so it stays unique), at most
    ``size`` UTF-8 bytes."""
    wide = ch.choice(("é", "日", "😀", "\u0301", "\u202e", "\u200b", " "))
    shape = pick(
        ch,
        (
            lambda: token,
            lambda: f" {token} ",
            lambda: f"\t{token}\n",
            lambda: f"a/b/../{token}/",
            lambda: f"/{token}",
            lambda: f"C:\\{token}\\x",
            lambda: f"\x00{token}\x00",
            lambda: f"{token}\r\n\x1b[31m",
            lambda: f"%s%n{token}%%",
            lambda: f"${{jndi:ldap://x/{token}}}",
            lambda: f"'; DROP TABLE jobs; -- {token}",
            lambda: f'{{"id": "{token}"}}',
            lambda: f"<script>{token}</script>",
            lambda: f"{token}\u202egnp.exe",
            lambda: f"e\u0301{token}\u200d😀\ufe0f",
            lambda: f"日本語{token}",
            lambda: (
                f"{token}\U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522"
            ),
            lambda: f"\U000e0041{token}\U0010ffff",
            lambda: fill_utf8(f"{token}-", size, wide),
            lambda: fill_utf8(f"{token}-", size - 1, "😀"),
            lambda: fill_utf8(token, ch.integer(len(token.encode()), size), wide),
            lambda: token + random_text(ch.rng(), ch.integer(0, 64)),
        ),
    )
    return cut_utf8(shape, size) if len(shape.encode()) > size else shape


# -- attributes -----------------------------------------------------------------------------

TRACEPARENTS = (
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-00000000000000000000000000000000-0000000000000000-01",
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
    "garbage",
    "",
    "é" * 512,
    "00-" + "a" * 1021,
)
TRACESTATES = ("a=b", ",,,", "é=ü", "k=v," * 200, "a" * 1024, "=\x00=")
FORGED = {
    c.ATTR_ERROR_TYPE: "forged",
    c.ATTR_ERROR_MESSAGE: "é" * 512,
    c.ATTR_DELIVERY_ATTEMPT: "-1",
    c.ATTR_WORKER: "someone-else",
    c.ATTR_FAILED_AT: "yesterday",
    c.ATTR_SOURCE_TOPIC: "projects/x/topics/y",
    c.ATTR_SOURCE_SUBSCRIPTION: "\x00",
    c.ATTR_PUBSUB_DELIVERY_COUNT: "99",
}


def attribute_value(ch: Chooser) -> str:
    return pick(
        ch,
        (
            lambda: "",
            lambda: " ",
            lambda: "\x00",
            lambda: "\t\n\r\x7f",
            lambda: "null",
            lambda: '{"job": "x"}',
            lambda: "a" * 1024,
            lambda: fill_utf8("", 1024, ch.choice(("é", "日", "😀"))),
            lambda: fill_utf8("v", 1024, ch.choice(("é", "日", "😀"))),
            lambda: cut_utf8(random_text(ch.rng(), 600), 1024),
        ),
    )


def attribute_key(ch: Chooser, i: int, *, first: str = "") -> str:
    """A unique key (``i``) of some shape; starting with ``first`` when given."""
    key = pick(
        ch,
        (
            lambda: f"x{i}",
            lambda: f"{i}",
            lambda: f"K{i}",
            lambda: f"_{i}",
            lambda: f" {i} ",
            lambda: f"ключ{i}",
            lambda: f"😀{i}",
            lambda: f"a/b.{i}:c",
            lambda: f"{c.ATTR_PUBSUB_DEAD_LETTER_PREFIX}{i}",
            lambda: fill_utf8(f"{i}-", MAX_KEY_BYTES, ch.choice(("é", "日", "😀"))),
            lambda: f"{i}" + cut_utf8(random_text(ch.rng(), 40), 200),
        ),
    )
    key = first + key if first and not key.startswith(first) else key
    return cut_utf8(key if not key.lower().startswith("goog") else f"x{key}", MAX_KEY_BYTES)


def extra_attributes(ch: Chooser, count: int, *, first: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for i in range(count):
        key = attribute_key(ch, i, first=first)
        if key and key not in (c.ATTR_JOB, c.ATTR_JOB_ID, "case"):
            out[key] = attribute_value(ch)
    return out


def unknown_job_name(ch: Chooser, target: Target, token: str) -> str:
    known = ch.choice(sorted(target.registered))
    name: str = pick(
        ch,
        (
            lambda: f" {known}",
            lambda: f"{known} ",
            lambda: f"{known}\n",
            lambda: f"{known}\x00",
            lambda: known.upper(),
            lambda: known.replace(".", "/"),
            lambda: known.replace(".", "\u2024"),  # one dot leader
            lambda: known.replace("o", "\u043e"),  # Cyrillic o
            lambda: known[:1] + "\u200b" + known[1:],
            lambda: "".join(chr(ord(x) + 0xFEE0) if "!" <= x <= "~" else x for x in known),
            lambda: known + "\u0301",
            lambda: "\u202e" + known,
            lambda: known * (1024 // len(known)),
            lambda: " ",
            lambda: "\t",
            lambda: "\u3000",
            lambda: "\x00",
            lambda: "null",
            lambda: "None",
            lambda: "0",
            lambda: "job",
            lambda: "../../etc/passwd",
            lambda: "%s%s%n",
            lambda: "${jndi:ldap://x/a}",
            lambda: "a" * 1024,
            lambda: "é" * 512,
            lambda: fill_utf8("", 1024, "😀"),
            lambda: shapes(ch, token, 1024),
        ),
    )
    return name if name not in target.registered else f"{name}?"


MISSING_JOB_KEYS = ("Job", "JOB", "job ", " job", "j\u043eb", "job\u200b", "jobs", "job_name")


@dataclass
class Attrs:
    values: dict[str, str] = field(default_factory=dict)
    job_state: str = "ok"  # or "missing", "unknown"


def job_attributes(ch: Chooser, target: Target, job: str, token: str, family: str) -> Attrs:
    """The ``job`` and ``job_id`` attributes, in the shape ``family`` asks for."""
    if family == "missing-job":
        how = ch.choice(("absent", "empty", "other-key"))
        values = {c.ATTR_JOB_ID: shapes(ch, token, 1024)}
        if how == "empty":
            values[c.ATTR_JOB] = ""
        elif how == "other-key":
            values[ch.choice(MISSING_JOB_KEYS)] = job
        return Attrs(values, "missing")
    if family == "unknown-job":
        name = unknown_job_name(ch, target, token)
        return Attrs({c.ATTR_JOB: name, c.ATTR_JOB_ID: shapes(ch, token, 1024)}, "unknown")
    if family == "no-job-id":
        return Attrs({c.ATTR_JOB: job, **ch.choice(({}, {c.ATTR_JOB_ID: ""}))})
    job_id = shapes(ch, token, 1024) if family == "job-id-shape" else token
    return Attrs({c.ATTR_JOB: job, c.ATTR_JOB_ID: job_id})


def decorate(ch: Chooser, target: Target, attrs: dict[str, str]) -> dict[str, str]:
    """Add what a hostile publisher might: trace context, forged failure attributes, and
    extra attributes up to the 100-attribute limit."""
    out = dict(attrs)
    room = c.MAX_ATTRIBUTES - target.reserved_attributes - len(out)
    how = ch.choice(("trace", "forged", "some", "all"))
    if how == "trace":
        out[c.ATTR_TRACEPARENT] = ch.choice(TRACEPARENTS)
        if ch.integer(0, 1):
            out[c.ATTR_TRACESTATE] = ch.choice(TRACESTATES)
    elif how == "forged":
        out.update(FORGED)
    elif how == "some":
        out.update(extra_attributes(ch, ch.integer(1, 8)))
    else:
        # Keys sort after "case", so a record cut to 100 attributes keeps the caller's id.
        out.update(extra_attributes(ch, room, first="x"))
    while len(out) > c.MAX_ATTRIBUTES - target.reserved_attributes:
        out.popitem()
    return out


# -- cases ----------------------------------------------------------------------------------

KINDS = (
    "plain",
    "body",
    "body",
    "body",
    "job-id-shape",
    "no-job-id",
    "decorated",
    "missing-job",
    "unknown-job",
    "deep",
    "large",
)


def expected_outcome(
    target: Target, data: bytes, job_state: str, body_expected: str | None
) -> str | None:
    """Which check fails first (see the module docstring), else the body's own outcome."""
    if len(data) > target.max_payload_bytes:
        return c.ERR_OVERSIZE
    if job_state == "missing":
        return c.ERR_MISSING_JOB
    if job_state == "unknown":
        return c.ERR_UNKNOWN_JOB
    return body_expected


def build_case(
    ch: Chooser, target: Target, kind: str, token: str, *, small: int, large: int
) -> Case:
    """One case of ``kind`` (one of ``KINDS``); ``token`` makes its job id unique; bodies stay
    under ``small`` bytes except for the "large" kind (up to ``large``)."""
    job = ch.choice((target.dict_job, *(t.name for t in target.typed)))
    family = kind if kind in ("missing-job", "unknown-job", "job-id-shape", "no-job-id") else ""
    attrs = job_attributes(ch, target, job, token, family)
    if kind == "plain":
        typed = next((t for t in target.typed if t.name == job), None)
        body = Body((typed.valid[0] if typed else "{}").encode(), RUN)
    elif kind == "deep":
        body = Body(ch.choice(DEEP_NOT_JSON), c.ERR_NOT_JSON)
    elif kind == "large":
        body = large_body(ch, target, job, large)
    else:
        body = body_for(ch, target, job, small=small)
    values = attrs.values
    if kind in ("decorated", "missing-job", "unknown-job") or ch.integer(0, 9) == 0:
        values = decorate(ch, target, values)
    expected = expected_outcome(target, body.data, attrs.job_state, body.expected)
    return Case(kind, body.data, values, expected)


def large_body(ch: Chooser, target: Target, job: str, large: int) -> Body:
    """A body near or over ``max_payload_bytes`` (but at most ``large`` bytes)."""
    limit = target.max_payload_bytes
    size = ch.choice((limit, limit + 1, ch.integer(limit // 2, limit), large))
    size = max(16, min(size, large))
    typed = next((t for t in target.typed if t.name == job), None)
    if typed is None:  # a long string, multibyte at the end
        text = fill_utf8('{"a": "', size - 2, ch.choice(("x", "é", "😀"))) + '"}'
        return Body(text.encode(), RUN)
    rng = ch.rng()
    return Body(b"\xff" + rng.randbytes(size - 1), c.ERR_NOT_JSON)


def check_publishable(case: Case, reserved: int = 0) -> None:
    """Raise if the case is not something Pub/Sub's publisher would accept (a grammar bug)."""
    attributes = case.attributes
    assert len(attributes) <= c.MAX_ATTRIBUTES - reserved, len(attributes)
    for key, value in attributes.items():
        assert 1 <= len(key.encode()) <= MAX_KEY_BYTES, key
        assert not key.startswith("goog"), key
        assert len(value.encode()) <= c.MAX_ATTRIBUTE_VALUE_BYTES, key
    size = len(case.data) + sum(len(k.encode()) + len(v.encode()) for k, v in attributes.items())
    assert size <= c.MAX_MESSAGE_BYTES, size
    texts = [*attributes, *attributes.values()]
    assert FORBIDDEN_WORD.encode() not in case.data.lower(), "a log check would trip"
    assert not any(FORBIDDEN_WORD in t.lower() for t in texts), "a log check would trip"


def generate(
    target: Target,
    count: int,
    *,
    seed: int,
    small: int = 16 * 1024,
    large: int = c.MAX_MESSAGE_BYTES - 200_000,
    kinds: Sequence[str] = KINDS,
) -> list[Case]:
    """``count`` cases, deterministic for a ``seed``, cycling through ``kinds`` so even a few
    cover every kind; ids are unique (``<seed>-<n>`` inside their shape)."""
    rng = random.Random(seed)
    chooser = RandomChooser(rng)
    out = []
    for n in range(count):
        case = build_case(
            chooser, target, kinds[n % len(kinds)], f"{seed}-{n}", small=small, large=large
        )
        check_publishable(case, target.reserved_attributes)
        out.append(case)
    return out


@st.composite
def cases(
    draw: Callable[[st.SearchStrategy[Any]], Any],
    target: Target,
    *,
    small: int = 4096,
    large: int = 64 * 1024,
    kinds: Sequence[str] = KINDS,
) -> Case:
    """The hypothesis strategy of the same grammar."""
    chooser = DrawChooser(draw)
    kind = chooser.choice(kinds)
    token = f"h-{chooser.integer(0, 10**9)}"
    case = build_case(chooser, target, kind, token, small=small, large=large)
    check_publishable(case, target.reserved_attributes)
    return case


# Arbitrary attributes Pub/Sub would accept, and arbitrary bodies: no expected outcome, only
# that there is exactly one.
publishable_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
soup_attributes = st.dictionaries(
    st.sampled_from([c.ATTR_JOB, c.ATTR_JOB_ID, c.ATTR_TRACEPARENT, "x"])
    | publishable_text.filter(lambda k: 0 < len(k.encode()) <= MAX_KEY_BYTES),
    publishable_text,
    max_size=8,
).map(lambda d: {k: v for k, v in d.items() if not k.startswith("goog")})
soup_bodies = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(NOT_JSON + NOT_OBJECT),
    st.builds(
        lambda v: json.dumps(v).encode(),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
            allow_infinity=False) | st.text(st.characters(exclude_categories=())),
            lambda inner: st.lists(inner, max_size=3)
            | st.dictionaries(st.text(st.characters(exclude_categories=())), inner, max_size=3),
            max_leaves=8,
        ),
    ),
)  # fmt: skip
