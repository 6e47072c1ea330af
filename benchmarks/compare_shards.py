#!/usr/bin/env python3
"""Compare the hidden states of two extractions of the same data (e.g. vLLM against transformers).

  python benchmarks/compare_shards.py A/manifest.json B/manifest.json [--tol 0.03] [--json FILE]

A and B are manifests or part manifests with the same layer ids, splits and batches. Per layer
id: relative error ||a - b|| / ||b|| over all tokens, max abs error, max |b|. Token ids and
sample indices must be equal. Exits 1 when a relative error is above --tol (or anything differs).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eaglepipe.shard_manifest import load_manifest, shard_paths  # noqa: E402
from eaglepipe.shards import read_shard  # noqa: E402


def compare(a_path: str, b_path: str) -> dict:
    a, b = load_manifest(a_path), load_manifest(b_path)
    if a["layer_ids"] != b["layer_ids"]:
        raise SystemExit(f"layer ids differ: {a['layer_ids']} vs {b['layer_ids']}")
    ids = a["layer_ids"]
    se = torch.zeros(len(ids), dtype=torch.float64)
    sn = torch.zeros(len(ids), dtype=torch.float64)
    mx = torch.zeros(len(ids))
    ref = torch.zeros(len(ids))
    tokens = 0
    for split in sorted(set(a["splits"]) | set(b["splits"])):
        ra = {r["batch"]: p for p, r in shard_paths(a, split)}
        rb = {r["batch"]: p for p, r in shard_paths(b, split)}
        if ra.keys() != rb.keys():
            raise SystemExit(f"{split}: batches differ: {sorted(ra.keys() ^ rb.keys())}")
        for batch in sorted(ra):
            sa, sb = read_shard(ra[batch]), read_shard(rb[batch])
            if not (torch.equal(sa.input_ids, sb.input_ids) and torch.equal(sa.sample_index, sb.sample_index)):
                raise SystemExit(f"{split} batch {batch}: token ids or samples differ")
            x, y = sa.hidden_states.float(), sb.hidden_states.float()  # [T, L, H]
            d = x - y
            se += d.double().pow(2).sum(dim=(0, 2))
            sn += y.double().pow(2).sum(dim=(0, 2))
            mx = torch.maximum(mx, d.abs().amax(dim=(0, 2)))
            ref = torch.maximum(ref, y.abs().amax(dim=(0, 2)))
            tokens += x.shape[0]
    rel = (se / sn.clamp_min(1e-30)).sqrt()
    rows = [{"layer_id": k, "rel_err": rel[i].item(), "max_abs_err": mx[i].item(), "max_abs_ref": ref[i].item()}
            for i, k in enumerate(ids)]
    return {"a": a_path, "b": b_path, "backend_a": a.get("backend"), "backend_b": b.get("backend"),
            "tokens": tokens, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tol", type=float, default=0.03, help="largest allowed relative error per layer id")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    res = compare(args.a, args.b)
    res["tol"] = args.tol
    res["ok"] = all(r["rel_err"] <= args.tol for r in res["rows"])
    print(f"{res['backend_a']} vs {res['backend_b']}: {res['tokens']} tokens, token ids equal")
    print(f"{'layer id':>8} {'rel err':>10} {'max abs':>10} {'max|ref|':>10}")
    for r in res["rows"]:
        flag = "" if r["rel_err"] <= args.tol else f"  > tol {args.tol}"
        print(f"{r['layer_id']:>8} {r['rel_err']:10.3e} {r['max_abs_err']:10.3e} {r['max_abs_ref']:10.3e}{flag}")
    print("COMPARE " + ("OK" if res["ok"] else "FAIL"))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
