"""Draft vocabulary mapping: speculators' selection, the invariants its Eagle3 model checks, the CLI."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglepipe.vocab_mapping import main


def write_freq(path, freq, **meta):
    save_file({"token_freq": freq}, str(path), metadata={"vocab_size": str(freq.numel()), **meta})
    return path


def load(path):
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("d2t"), f.get_tensor("t2d"), f.metadata()


def check_invariants(d2t, t2d, draft, target):
    # what speculators' Eagle3 model checks when it loads the mapping (model.py, load_vocab_mappings)
    assert d2t.dtype == torch.int64 and d2t.shape == (draft,)
    assert t2d.dtype == torch.bool and t2d.shape == (target,)
    assert int(t2d.sum()) == draft
    target_ids = torch.arange(draft) + d2t  # target_id = draft_idx + d2t[draft_idx]
    assert torch.equal(target_ids, torch.nonzero(t2d).flatten())  # sorted, unique, the same set
    assert int(target_ids.min()) >= 0 and int(target_ids.max()) < target


def test_most_frequent_tokens_are_kept(tmp_path):
    freq = torch.zeros(100, dtype=torch.int64)
    seen = [90 - 5 * i for i in range(17)]  # 17 tokens seen, the last (id 10) once
    freq[seen] = torch.arange(17, 0, -1)
    out = tmp_path / "vm.safetensors"
    main(["--token-freq", str(write_freq(tmp_path / "f.safetensors", freq, template_digest="abc")),
          "--draft-vocab-size", "16", "--out", str(out)])
    d2t, t2d, meta = load(out)
    check_invariants(d2t, t2d, 16, 100)
    assert torch.nonzero(t2d).flatten().tolist() == sorted(seen[:16])
    assert meta["draft_vocab_size"] == "16" and meta["target_vocab_size"] == "100"
    assert float(meta["coverage"]) == pytest.approx(152 / 153)
    assert meta["template_digest"] == "abc"


def test_fewer_seen_tokens_than_the_draft_vocab_are_filled_by_speculators(tmp_path):
    freq = torch.zeros(50, dtype=torch.int64)
    freq[[40, 45]] = 3
    out = tmp_path / "vm.safetensors"
    main(["--token-freq", str(write_freq(tmp_path / "f.safetensors", freq)), "--draft-vocab-size", "16",
          "--out", str(out)])
    d2t, t2d, meta = load(out)
    check_invariants(d2t, t2d, 16, 50)
    assert t2d[40] and t2d[45] and float(meta["coverage"]) == 1.0


def test_draft_vocab_is_capped_at_the_target_vocab(tmp_path, capsys):
    freq = torch.arange(32, dtype=torch.int64)
    out = tmp_path / "vm.safetensors"
    main(["--token-freq", str(write_freq(tmp_path / "f.safetensors", freq)), "--draft-vocab-size", "64",
          "--out", str(out)])
    d2t, t2d, meta = load(out)
    check_invariants(d2t, t2d, 32, 32)
    assert bool(t2d.all()) and meta["requested_draft_vocab_size"] == "64"
    assert "capped at the target vocabulary 32" in capsys.readouterr().err


def test_bad_inputs_are_clear_errors(tmp_path):
    out = str(tmp_path / "vm.safetensors")
    with pytest.raises(SystemExit, match="cannot read token frequencies"):
        main(["--token-freq", str(tmp_path / "missing.safetensors"), "--draft-vocab-size", "16", "--out", out])
    save_file({"counts": torch.zeros(4, dtype=torch.int64)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(SystemExit, match=r"no tensor 'token_freq' \(found \['counts'\]\)"):
        main(["--token-freq", str(tmp_path / "other.safetensors"), "--draft-vocab-size", "16", "--out", out])
    bad = write_freq(tmp_path / "float.safetensors", torch.ones(8))
    with pytest.raises(SystemExit, match="must be a 1-D int64 tensor"):
        main(["--token-freq", str(bad), "--draft-vocab-size", "16", "--out", out])
