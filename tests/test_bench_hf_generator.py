"""benchmarks/bench_hf_generator.py on a tiny random Llama: every row answers every prompt, ours
at each batch size gives the answers of ours at batch 1, and greedy generate() gives them too."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import tiny

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_rows_and_answers(tiny_llama, tmp_path, monkeypatch, capsys):
    import bench_hf_generator

    chats = tiny.make_chats(tmp_path / "chats.jsonl", n=7)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_hf_generator.py", "--model", str(tiny_llama), "--data", str(chats),
                                      "--max-new-tokens", "12", "--temperature", "0", "--batch-sizes", "1,3",
                                      "--json", str(out)])
    bench_hf_generator.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["generate, one at a time", "ours, batch 1", "ours, batch 3"]
    assert {r["prompts"] for r in rows} == {7} and len({r["tokens"] for r in rows}) == 1
    assert [r["same_as_reference"] for r in rows] == [7, 7, 7]  # greedy: generate() is the same decoder
    table = capsys.readouterr().out
    assert re.search(r"\| ours, batch 3 \| \d+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+x \| 7 / 7 \|", table)
