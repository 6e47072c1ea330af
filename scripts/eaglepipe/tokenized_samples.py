"""Token-exact samples: the file regenerate_responses writes and prepare_data takes as it is.

One JSON object per line: ``id`` (unique), ``conversation`` (the source conversation's id: the
train/eval split is drawn by it, so all samples of one conversation land in the same split, the
one prepare_data gives the original chat: regenerated and original data split alike),
``input_ids``, ``loss_mask`` (1 on the tokens the target generated), and fields for people that
readers ignore (``mode``, ``answers``). Nothing is re-tokenized, so no mask can shift.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterator, NamedTuple

from eaglepipe.chat_data import Skip
from eaglepipe.chat_template import Encoded, Part, Sample


class Tokenized(NamedTuple):
    id: str
    conversation: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str  # "file:line"


def dumps(sample_id: str, conversation: str, input_ids: list[int], loss_mask: list[int], **for_people) -> str:
    return json.dumps({"id": sample_id, "conversation": conversation, "input_ids": input_ids,
                       "loss_mask": loss_mask, **for_people}, ensure_ascii=False, separators=(",", ":"))


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
    return Tokenized(record["id"], record["conversation"], ids, mask, source)


def iter_tokenized(path: str) -> Iterator[Tokenized | Skip]:
    """Yield a ``Tokenized`` or a ``Skip`` for every line of ``path`` in file order."""
    if not Path(path).is_file():
        raise SystemExit(f"token-exact sample file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            source = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield Skip(source, "bad_json", f"{source}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            yield validate(record, source)
