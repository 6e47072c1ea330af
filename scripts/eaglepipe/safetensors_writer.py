"""Write a safetensors file from tensor pieces, hashing the bytes on their way to the file.

Written here because safetensors' ``save_file`` falls short for extraction, which writes ~16 KB
per token: it needs every tensor whole (one concatenation copy per shard), serialises it through
another buffer, and returns no checksum (one more read of the file). Measured on 256 MiB of bf16,
2 cores: concatenation 1.0 GiB/s, ``save_file`` 0.65 GiB/s, re-reading for sha256 1.3 GiB/s. Here
each tensor is given as pieces along dim 0 (one per sample), streamed from the backend's buffers
straight into the file, and hashed in the same pass. The file is the documented format (8-byte
little-endian header size, JSON header padded with spaces to 8 bytes, then the data) and is read
back with safetensors itself.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence

import torch

from .checksum import hasher

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
CHUNK = 16 << 20  # hash a chunk while it is still in cache, then write it


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def header_entry(name: str, pieces: Sequence[torch.Tensor], offset: int) -> dict:
    """The header entry of ``pieces`` concatenated along dim 0; checks they can be."""
    if not pieces:
        raise ValueError(f"tensor {name!r}: no pieces")
    first = pieces[0]
    if first.dtype not in DTYPE_NAMES:
        raise ValueError(f"tensor {name!r}: dtype {first.dtype} has no safetensors name")
    for p in pieces:
        if p.dtype != first.dtype or p.dim() != first.dim() or p.shape[1:] != first.shape[1:] or p.dim() == 0:
            raise ValueError(f"tensor {name!r}: pieces of shape {tuple(p.shape)} {p.dtype} and "
                             f"{tuple(first.shape)} {first.dtype} do not concatenate along dim 0")
    nbytes = sum(p.numel() for p in pieces) * first.element_size()
    shape = [sum(p.shape[0] for p in pieces), *first.shape[1:]]
    return {"dtype": DTYPE_NAMES[first.dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}


def save_pieces(path: str | os.PathLike, tensors: dict[str, Sequence[torch.Tensor]],
                metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write ``{name: pieces}`` (each concatenated along dim 0) to ``path``; return (size, checksum)."""
    header: dict = {}
    offset = 0
    for name, pieces in tensors.items():
        header[name] = header_entry(name, pieces, offset)
        offset = header[name]["data_offsets"][1]
    if metadata:
        header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    h = hasher()
    size = 0
    with open(path, "wb", buffering=0) as f:
        def put(buf: memoryview) -> None:
            nonlocal size
            for start in range(0, len(buf), CHUNK):
                chunk = buf[start:start + CHUNK]
                h.update(chunk)  # releases the GIL: writer threads hash in parallel
                while chunk:
                    chunk = chunk[f.write(chunk):]
            size += len(buf)

        put(memoryview(struct.pack("<Q", len(head)) + head))
        for pieces in tensors.values():
            for p in pieces:
                put(_as_bytes(p))
    return size, h.hexdigest()
