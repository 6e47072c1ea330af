"""Tokenized samples: the two JSONL record forms that carry token ids and a loss mask.

Prepared samples, the files prepare_data writes (train/eval) and benchmark_serving's parity
samples: one JSON object per line, ``{id, input_ids, loss_mask, category?, prompt_set?}``
(``category``: the source conversation's, read as chat_data reads it; ``prompt_set``: the fixed
evaluation set an eval sample came from), ids unique within the file.
Extraction reads them (``read_prepared``, strict: a malformed line is an error), and so does
benchmark_serving for its prompts (``iter_prepared``).

Token-exact samples, the file regenerate_responses writes and prepare_data takes as it is:
one JSON object per line: ``id`` (unique), ``conversation`` (the source conversation's id: the
train/eval split is drawn by it, so all samples of one conversation land in the same split, the
one prepare_data gives the original chat: regenerated and original data split alike),
``input_ids``, ``loss_mask`` (1 on the tokens the target generated), ``category`` when the source
conversation has one (read as chat_data reads it; carried on to the evaluation strata),
``prompt_set`` for a fixed evaluation set's samples (the set's name, kept into the eval split), and fields
for people that readers ignore (``mode``, ``answers``). Nothing is re-tokenized, so no mask can shift.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

from eaglepipe.chat_data import Skip, category_of
from eaglepipe.chat_template import Encoded, Part, Sample


class Tokenized(NamedTuple):
    id: str
    conversation: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str  # "file:line"
    category: str | None = None
    prompt_set: str | None = None  # the fixed evaluation set it came from


def dumps(sample_id: str, conversation: str, input_ids: list[int], loss_mask: list[int],
          category: str | None = None, **for_people) -> str:
    category_field = {"category": category} if category else {}
    return json.dumps({"id": sample_id, "conversation": conversation, "input_ids": input_ids,
                       "loss_mask": loss_mask, **category_field, **for_people}, ensure_ascii=False,
                      separators=(",", ":"))


def as_encoded(sample: Tokenized) -> Encoded:
    """The sample in the form chat_template gives a tokenized conversation: one whole sample, each
    run of masked tokens a turn (its thinking and answer are not told apart: kind "regenerated")."""
    parts, token_parts = [], []
    for i, m in enumerate(sample.loss_mask):
        if m and not (i and sample.loss_mask[i - 1]):
            parts.append(Part(len(parts), "regenerated"))
        token_parts.append(len(parts) - 1 if m else -1)
    whole = Sample(True, tuple(range(len(parts))), sample.input_ids, token_parts)
    return Encoded([whole], parts, len(parts), Counter(), Counter(), 0)


def _json_lines(path: str | os.PathLike) -> Iterator[tuple[int, object]]:
    """(line number, the parsed record or its ``json.JSONDecodeError``) of each non-blank line."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    record = e
                yield line_no, record


def _is_id_list(value) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def validate(record, source: str) -> Tokenized | Skip:
    """A checked sample, or the reason it is unusable."""
    if not isinstance(record, dict):
        return Skip(source, "not_an_object", f"{source}: record is a {type(record).__name__}, expected a JSON object")
    for key in ("id", "conversation"):
        if not isinstance(record.get(key), str) or not record[key]:
            return Skip(source, "missing_field", f"{source}: field {key!r} must be a non-empty string")
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not _is_id_list(ids) or not ids:
        return Skip(source, "bad_token_ids", f"{source}: 'input_ids' must be a non-empty list of token ids")
    if not isinstance(mask, list) or any(m not in (0, 1) or type(m) is not int for m in mask):
        return Skip(source, "bad_loss_mask", f"{source}: 'loss_mask' must be a list of 0/1")
    if len(mask) != len(ids):
        return Skip(source, "bad_loss_mask", f"{source}: 'loss_mask' has {len(mask)} entries for {len(ids)} tokens")
    if not any(mask):
        return Skip(source, "no_assistant_token", f"{source}: 'loss_mask' marks no token")
    prompt_set = record.get("prompt_set")
    return Tokenized(record["id"], record["conversation"], ids, mask, source, category_of(record),
                     prompt_set if isinstance(prompt_set, str) and prompt_set else None)


def iter_tokenized(path: str) -> Iterator[Tokenized | Skip]:
    """Yield a ``Tokenized`` or a ``Skip`` for every line of ``path`` in file order."""
    if not Path(path).is_file():
        raise SystemExit(f"token-exact sample file {path} does not exist")
    for line_no, record in _json_lines(path):
        source = f"{path}:{line_no}"
        if isinstance(record, json.JSONDecodeError):
            yield Skip(source, "bad_json", f"{source}: not valid JSON ({record.msg} at column {record.colno})")
        else:
            yield validate(record, source)


@dataclass
class PreparedSample:
    index: int  # position in its file (extraction stores it as the shard's sample_index)
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    category: str | None = None  # extraction records it in the manifest, for the evaluation strata
    prompt_set: str | None = None  # likewise: the fixed evaluation set it came from


def iter_prepared(path: str | os.PathLike) -> Iterator[PreparedSample]:
    """The prepared samples of ``path`` in file order; a malformed record is an error naming file
    and line (lazily: a reader that stops early never sees the lines after)."""
    seen: dict[str, int] = {}
    for lineno, rec in _json_lines(path):
        where = f"{path} line {lineno}"
        if isinstance(rec, json.JSONDecodeError):
            raise SystemExit(f"{where}: not valid JSON ({rec})") from rec
        if not isinstance(rec, dict):
            raise SystemExit(f"{where}: expected an object with id, input_ids, loss_mask")
        for key in ("id", "input_ids", "loss_mask"):
            if key not in rec:
                raise SystemExit(f"{where}: missing field {key!r} (need id, input_ids, loss_mask)")
        ids, mask = rec["input_ids"], rec["loss_mask"]
        if not _is_id_list(ids) or not ids:
            raise SystemExit(f"{where}: field 'input_ids' must be a non-empty list of token ids >= 0")
        if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
            raise SystemExit(f"{where}: field 'loss_mask' must be a list of 0/1 as long as input_ids "
                             f"({len(ids)}), got {len(mask) if isinstance(mask, list) else type(mask).__name__}")
        sid = str(rec["id"])
        if sid in seen:
            raise SystemExit(f"{where}: id {sid!r} repeats line {seen[sid]}; ids must be unique")
        prompt_set = rec.get("prompt_set")
        yield PreparedSample(len(seen), sid, ids, mask, category_of(rec),
                             prompt_set if isinstance(prompt_set, str) and prompt_set else None)
        seen[sid] = lineno


def read_prepared(path: str | os.PathLike) -> list[PreparedSample]:
    return list(iter_prepared(path))
