"""Shard and manifest format: round trips (bf16 and fp8), validity checks, manifest errors."""

import json

import pytest
import torch
import xxhash

from eaglepipe import shard_manifest, shards
from eaglepipe.shards import bytes_per_token


def make_batch(lengths=(5, 3, 7), L=4, H=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return dict(
        hidden_states=(torch.randn(T, L, H, generator=g) * 3).to(torch.bfloat16),
        input_ids=torch.randint(0, 1000, (T,), generator=g),
        loss_mask=torch.randint(0, 2, (T,), generator=g),
        sample_index=torch.tensor([10, 11, 12]),
        offsets=offsets,
    )


def test_round_trip_model_dtype(tmp_path):
    b = make_batch()
    row = shards.write_shard(tmp_path / "s.safetensors", **b, metadata={"layer_ids": [1, 2, 3, 4]})
    assert row["file"] == "s.safetensors" and row["samples"] == 3 and row["tokens"] == 15
    assert row["bytes"] == (tmp_path / "s.safetensors").stat().st_size
    s = shards.read_shard(tmp_path / "s.safetensors")
    assert torch.equal(s.hidden_states, b["hidden_states"]) and s.hidden_states.dtype == torch.bfloat16
    assert torch.equal(s.input_ids, b["input_ids"]) and torch.equal(s.offsets, b["offsets"])
    assert s.metadata["layer_ids"] == [1, 2, 3, 4] and s.metadata["storage_dtype"] == "model"
    one = s.sample(1)
    assert one["index"] == 11 and torch.equal(one["hidden_states"], b["hidden_states"][5:8])
    assert shards.shard_is_valid(tmp_path / "s.safetensors", row)
    # the checksum hashed while writing is the XXH3-128 of the file as stored
    assert row["xxh3_128"] == xxhash.xxh3_128((tmp_path / "s.safetensors").read_bytes()).hexdigest()
    assert not list(tmp_path.glob(".tmp-*"))


def test_round_trip_fp8_halves_aux_bytes(tmp_path):
    L, H = 4, 256
    b = make_batch(lengths=(50, 30, 70), L=L, H=H)
    r16 = shards.write_shard(tmp_path / "a.safetensors", **b, metadata={})
    r8 = shards.write_shard(tmp_path / "b.safetensors", **b, metadata={}, storage_dtype="fp8")
    s = shards.read_shard(tmp_path / "b.safetensors")
    assert s.hidden_states.shape == b["hidden_states"].shape and s.hidden_states.dtype == torch.bfloat16
    # the final layer is kept exactly; the aux layers lose a little precision
    assert torch.equal(s.hidden_states[:, -1], b["hidden_states"][:, -1])
    ref = b["hidden_states"][:, :-1].float()
    rel = (s.hidden_states[:, :-1].float() - ref).norm() / ref.norm()
    assert 0 < rel < 0.05
    # aux part per token: bf16 2 B x H per layer -> fp8 1 B x H + a 4 B scale
    T = 150
    aux16 = (L - 1) * H * 2
    aux8 = (r8["bytes"] - r16["bytes"]) / T + aux16
    assert aux8 == pytest.approx((L - 1) * (H + 4), abs=2)
    assert bytes_per_token(L, H, 2, "fp8") - bytes_per_token(L, H, 2, "model") == (L - 1) * (H + 4) - aux16


def test_write_shard_rejects_inconsistent_sizes(tmp_path):
    b = make_batch()
    b["input_ids"] = b["input_ids"][:-1]
    with pytest.raises(ValueError, match="hidden_states has 15 tokens, input_ids 14"):
        shards.write_shard(tmp_path / "s.safetensors", **b, metadata={})
    with pytest.raises(ValueError, match="storage dtype"):
        shards.write_shard(tmp_path / "s.safetensors", **make_batch(), metadata={}, storage_dtype="int4")


def test_truncated_or_tampered_shard_is_invalid(tmp_path):
    p = tmp_path / "s.safetensors"
    row = shards.write_shard(p, **make_batch(), metadata={})
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    assert not shards.shard_is_valid(p)
    p.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, other content
    assert shards.shard_is_valid(p) and not shards.shard_is_valid(p, row)
    p.write_bytes(b"\0" * len(data))
    assert not shards.shard_is_valid(p)
    assert not shards.shard_is_valid(tmp_path / "absent.safetensors")


def test_manifest_round_trip_and_errors(tmp_path):
    row = shards.write_shard(tmp_path / "shards" / "train-000000.safetensors", **make_batch(), metadata={})
    m = {"target": {"model": "x"}, "layer_ids": [2, 4], "shard_dir": "shards",
         "splits": {"train": {"shards": [dict(row, batch=0)]}}}
    shard_manifest.write_manifest(tmp_path / "manifest.json", m)
    loaded = shard_manifest.load_manifest(tmp_path / "manifest.json")
    [(path, r)] = shard_manifest.shard_paths(loaded, "train")
    assert path == tmp_path / "shards" / "train-000000.safetensors" and r["xxh3_128"] == row["xxh3_128"]
    with pytest.raises(ValueError, match="no split 'eval'"):
        shard_manifest.shard_paths(loaded, "eval")
    (tmp_path / "bad.json").write_text(json.dumps({k: v for k, v in m.items() if k != "splits"}))
    with pytest.raises(ValueError, match="missing key 'splits'"):
        shard_manifest.load_manifest(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps(dict(m, format_version=0)))
    with pytest.raises(ValueError, match="format version 0"):
        shard_manifest.load_manifest(tmp_path / "old.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="cannot be read"):
        shard_manifest.load_manifest(tmp_path / "broken.json")


@pytest.mark.parametrize("chunk_elements", [1 << 20, 5 * 3 * 96, 1])  # one chunk; 5 rows, ragged end; 1 row
def test_quantize_fp8_matches_the_float_absmax_reference(monkeypatch, chunk_elements):
    monkeypatch.setattr(shards, "FP8_CHUNK_ELEMENTS", chunk_elements)
    x = torch.randn(64, 4, 96).to(torch.bfloat16)[:, :-1]  # the aux layers: a strided view, as written
    x[0, 0] = 0  # an all-zero row keeps a tiny positive scale
    x[1, 1] = -x[1, 1].abs() * 50  # a row whose absmax is a negative value
    xf = x.float()
    ref_scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / shards.FP8_MAX
    ref = (xf / ref_scale.unsqueeze(-1)).to(shards.FP8)
    q, scale = shards.quantize_fp8(x)
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    back = shards.dequantize_fp8(q, scale, torch.float32)
    assert (back - xf).abs().max() <= 0.0625 * xf.abs().amax()  # e4m3: 3 mantissa bits
