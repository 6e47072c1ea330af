import json

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file

from eaglepipe.safetensors_writer import save_pieces


def test_pieces_read_back_with_safetensors_as_their_concatenation(tmp_path):
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(n, 3, 5, generator=g).to(torch.bfloat16) for n in (4, 1, 7)]
    fp8 = [s.float().to(torch.float8_e4m3fn) for s in states]
    ids = torch.arange(12, dtype=torch.int64)
    mask = torch.tensor([0, 1] * 6, dtype=torch.uint8)
    flags = torch.tensor([True, False, True])
    path = tmp_path / "x.safetensors"
    size, checksum = save_pieces(path, {"hidden_states": states, "fp8": fp8, "input_ids": [ids[:5], ids[5:]],
                                   "loss_mask": [mask], "flags": [flags]}, metadata={"k": json.dumps([1])})
    data = path.read_bytes()
    assert size == len(data) and checksum == xxhash.xxh3_128(data).hexdigest()
    back = load_file(path)
    assert torch.equal(back["hidden_states"], torch.cat(states))
    assert torch.equal(back["fp8"].view(torch.uint8), torch.cat(fp8).view(torch.uint8))
    assert torch.equal(back["input_ids"], ids) and torch.equal(back["loss_mask"], mask)
    assert torch.equal(back["flags"], flags)
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["k"]) == [1]
    assert (8 + int.from_bytes(data[:8], "little")) % 8 == 0  # data starts 8-byte aligned


def test_non_contiguous_pieces_are_written_in_logical_order(tmp_path):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 3, 2)
    save_pieces(tmp_path / "x.safetensors", {"last": [x[:, -1], x[:2, 0]]})
    assert torch.equal(load_file(tmp_path / "x.safetensors")["last"], torch.cat([x[:, -1], x[:2, 0]]))


@pytest.mark.parametrize("pieces", [
    [torch.zeros(2, 3), torch.zeros(2, 4)],
    [torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)],
    [torch.tensor(1.0)],
    [],
])
def test_pieces_that_do_not_concatenate_are_refused(tmp_path, pieces):
    with pytest.raises(ValueError, match="'t'"):
        save_pieces(tmp_path / "x.safetensors", {"t": pieces})
