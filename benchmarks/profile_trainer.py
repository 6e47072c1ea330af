#!/usr/bin/env python3
"""Issue 19: where a training step of eaglepipe.train_draft goes, phase by phase.

  python benchmarks/profile_trainer.py --manifest results/RUN/hidden_states/manifest.json \\
      --vocab results/RUN/data/vocab_mapping.safetensors --model TARGET_DIR \\
      [--steps 60] [--warmup 10] [--batch-tokens 8192] [--ttt-steps 3] [--device cuda] \\
      [--torch-profiler DIR] [--no-eval] --json OUT [any other train_draft flag: --lr, --loss, ...]

The draft, optimizer, schedule, loss config and packed rows are built by train_draft's own
parser, modules and defaults (flags this script does not know go to train_draft.parse_args).
Order: --warmup steps (the compile of the forward, flex attention included, happens here; each
step's ms is reported), then the same --steps rows (data position (0, warmup)) twice: unprofiled
(one synchronisation at each end) and profiled (a synchronisation and a clock read at every
phase boundary, which costs a little; both totals are reported). Phases of a step:
  next_row      waiting for the next packed row, packed ahead as train_draft's (--row-loader: a thread
                by default, or a worker process) (host)
  to_device     the row's tensors to the device (bf16 rows in page-locked memory on GPUs, as train_draft's)
  forward_loss  the draft's TTT forward with its loss (speculators computes the loss inside the
                forward, compiled with it on GPUs; its share is estimated separately below)
  backward      zero_grad + backward
  optimizer     grad clipping, the optimizer step(s) (--optimizer), scheduler step(s)
  stats         the per-step loss/accuracy stack and its read back to the host (train_draft's
                int(tokens) / float(loss), which synchronise every step)
Beside the step: row packing alone (PackedRows packing in the caller, host ms per row),
the loss's part of the forward (no-grad forward with vs without the verifier states), one or two
evaluation passes (train_draft's evaluation: evaluate_rows + eval_metrics on the eval split; the
first includes the compile of the eval shapes), optionally a torch.profiler trace of 5 steps.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from contextlib import closing
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from eaglepipe.acceptance import ROW_KEYS  # noqa: E402
from eaglepipe.atomic import write_json  # noqa: E402
from eaglepipe.draft_model import LOSS_IMPLEMENTATION, training_row_options  # noqa: E402
from eaglepipe.evaluation import Evaluation  # noqa: E402
from eaglepipe.layers import aux_layer_ids, validate_layer_ids  # noqa: E402
from eaglepipe.packed_data import PackedRows, add_row_loader_argument, shuffle_buffer, shuffle_window  # noqa: E402
from eaglepipe.runtime import set_threads, setup_distributed  # noqa: E402
from eaglepipe.settings import add_stage_arguments  # noqa: E402
from eaglepipe.shard_manifest import load_manifest  # noqa: E402
from eaglepipe.training import Optimization, check_training_args, new_draft  # noqa: E402

log = logging.getLogger("profile_trainer")
PHASES = ("next_row", "to_device", "forward_loss", "backward", "optimizer", "stats")
PROFILER_STEPS = 5


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this script's flags, train_draft's args for the rest)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="measured steps (each run)")
    p.add_argument("--warmup", type=int, default=10, help="steps before measuring (compile)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json", required=True, help="where the results go")
    p.add_argument("--torch-profiler", metavar="DIR", help="also write a torch.profiler trace of 5 steps here")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation passes")
    ours, rest = p.parse_known_args(argv)
    if ours.steps < 1 or ours.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    # train_draft's settings with the schema's defaults, as the stage's parser takes them
    t = argparse.ArgumentParser(prog="profile_trainer (train_draft's flags)")
    for name in ("--manifest", "--vocab", "--model"):
        t.add_argument(name, required=True)
    add_stage_arguments(t, "train_draft", types={"shuffle_buffer_gib": shuffle_buffer})
    add_row_loader_argument(t)
    targs = t.parse_args(rest)
    check_training_args(t, targs)
    return ours, targs


class PhaseClock:
    """Wall ms per phase; synchronises the device at every boundary so a phase's kernels count in it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ms: dict[str, list[float]] = {name: [] for name in PHASES}

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.t = self._sync()

    def mark(self, phase: str) -> None:
        now = self._sync()
        self.ms[phase].append((now - self.t) * 1000)
        self.t = now


class NoClock:
    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass


class Trainer:
    """train_draft.train()'s model, optimizer, schedule and rows, built by the same calls."""

    def __init__(self, targs, device: torch.device):
        from speculators.losses import resolve_loss_config

        self.targs, self.device = targs, device
        try:
            self.manifest = load_manifest(targs.manifest)
        except ValueError as e:
            raise SystemExit(str(e)) from e
        layer_ids = [int(i) for i in self.manifest["layer_ids"]]
        validate_layer_ids(layer_ids, int(self.manifest["target"].get("num_hidden_layers", layer_ids[-1])))
        torch.manual_seed(targs.seed)
        self.model = new_draft(targs, aux_layer_ids(layer_ids), device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimization = Optimization(targs, self.model)
        self.loss_config = resolve_loss_config(targs.loss, LOSS_IMPLEMENTATION)
        self.row_options = training_row_options(device, targs.batch_tokens)  # as train_draft's rows
        self.pad_to = self.row_options["pad_to"]
        self.model.train()

    def rows(self) -> PackedRows:
        """train_draft's training rows."""
        return PackedRows(self.manifest, "train", self.targs.batch_tokens, seed=self.targs.seed, shuffle=True,
                          shuffle_window=shuffle_window(self.manifest, "train", self.targs.shuffle_buffer_gib),
                          **self.row_options)

    def autocast(self):
        # as train_draft: bf16 autocast over fp32 weights on GPUs, fp32 on CPU
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def step(self, stream, clock) -> tuple[int, int]:
        """One step of train_draft's loop, mirrored (that loop is inline in train(), with logging,
        checkpoints and evaluation around it); returns (real tokens, row tokens incl. pads)."""
        a = self.targs
        clock.start()
        _, batch = next(stream)
        clock.mark("next_row")
        b = {k: batch[k].to(self.device, non_blocking=True) for k in ROW_KEYS}
        clock.mark("to_device")
        with self.autocast():
            _, loss, m = self.model(**b, ttt_steps=a.ttt_steps, ttt_step_loss_decay=a.ttt_step_loss_decay,
                                    loss_config=self.loss_config)
        clock.mark("forward_loss")
        self.optimization.zero_grad()
        loss.backward()
        clock.mark("backward")
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimization.step()
        clock.mark("optimizer")
        tokens = batch["lengths"].sum().reshape(1).to(self.device)
        stats = torch.stack([loss.detach().float()] + [m[f"full_acc_{s}_sum"].float() for s in range(a.ttt_steps)]
                            + [m[f"full_acc_{s}_total"].float() for s in range(a.ttt_steps)])
        real = int(tokens)
        float(stats[0])
        clock.mark("stats")
        return real, int(b["input_ids"].shape[1])

    def stream(self, index: int):
        return self.rows().prefetched(self.targs.row_loader, 0, index)

    def sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def run_steps(trainer: Trainer, steps: int, index: int, clock) -> dict:
    """``steps`` steps from data position (0, index); wall ms per step and tokens/s of the whole."""
    real = padded = 0
    with closing(trainer.stream(index)) as stream:
        t0 = trainer.sync()
        for _ in range(steps):
            r, p = trainer.step(stream, clock)
            real, padded = real + r, padded + p
        seconds = trainer.sync() - t0
    return {"steps": steps, "ms_per_step": round(seconds * 1000 / steps, 3),
            "tokens_per_s": round(real / seconds, 1), "real_tokens_per_step": round(real / steps, 1),
            "row_tokens_per_step": round(padded / steps, 1)}


def packing_ms(trainer: Trainer, rows: int, index: int) -> dict:
    """Host ms to pack one row, packed in the caller (what the row loader hides behind the step)."""
    ms = []
    batches = trainer.rows().stream(0, index)
    t = time.perf_counter()
    for _ in range(rows):
        _, batch = next(batches)
        now = time.perf_counter()
        ms.append((now - t) * 1000)
        t = now
    nbytes = sum(batch[k].numel() * batch[k].element_size() for k in ROW_KEYS)
    return {"median_ms": round(statistics.median(ms), 3), "rows": rows, "row_bytes": nbytes}


def loss_part_ms(trainer: Trainer, index: int, reps: int) -> dict:
    """No-grad forward of the same row with the verifier states (targets, loss, metrics) and without
    (draft tokens only): the difference estimates the loss's ms inside the training forward."""
    a = trainer.targs
    _, batch = next(trainer.rows().stream(0, index))
    b = {k: batch[k].to(trainer.device) for k in ROW_KEYS}
    no_loss = {k: v for k, v in b.items() if k != "verifier_last_hidden_states"}
    out = {}
    with torch.no_grad(), trainer.autocast():
        for name, inputs in (("with_loss", b), ("without_loss", no_loss)):
            for _ in range(2):  # compile of this variant
                trainer.model(**inputs, ttt_steps=a.ttt_steps, ttt_step_loss_decay=a.ttt_step_loss_decay,
                              loss_config=trainer.loss_config)
            ms = []
            for _ in range(reps):
                t = trainer.sync()
                trainer.model(**inputs, ttt_steps=a.ttt_steps, ttt_step_loss_decay=a.ttt_step_loss_decay,
                              loss_config=trainer.loss_config)
                ms.append((trainer.sync() - t) * 1000)
            out[f"forward_{name}_ms"] = round(statistics.median(ms), 3)
    out["loss_ms"] = round(out["forward_with_loss_ms"] - out["forward_without_loss_ms"], 3)
    return out


def eval_pass_ms(trainer: Trainer, evaluation: Evaluation) -> dict:
    """train_draft's evaluation (its run_eval without the metrics row): one pass over the eval split."""
    a = trainer.targs
    t = trainer.sync()
    ev = evaluation(trainer.model, a.ttt_steps, trainer.loss_config, a.batch_tokens, a.ttt_step_loss_decay)
    return {"ms": round((trainer.sync() - t) * 1000, 1), "acceptance_length": ev["acceptance_length"]}


def torch_profile(trainer: Trainer, out_dir: Path, index: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    out_dir.mkdir(parents=True, exist_ok=True)
    with closing(trainer.stream(index)) as stream, profile(activities=activities, record_shapes=True) as prof:
        for _ in range(PROFILER_STEPS):
            trainer.step(stream, NoClock())
        trainer.sync()
    prof.export_chrome_trace(str(out_dir / "trace.json"))
    # device_time_total: torch's current name of cuda_time_total (deprecated alias)
    sort = "device_time_total" if trainer.device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25)
    (out_dir / "key_averages.txt").write_text(table)
    return {"trace": str(out_dir / "trace.json"), "sorted_by": sort, "table": table}


def phase_table(ms: dict[str, list[float]]) -> dict:
    """Median ms per phase; share = the phase's total over all phases' total (so the shares add up to 100)."""
    total = sum(sum(v) for v in ms.values())
    return {name: {"median_ms": round(statistics.median(v), 3), "mean_ms": round(statistics.mean(v), 3),
                   "share_pct": round(100 * sum(v) / total, 2)} for name, v in ms.items()}


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    ours, targs = parse_args(argv)
    threads = set_threads()
    if ours.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible")
        _, _, device = setup_distributed()  # cuda:0 and TF32 for the fp32 parts, as train_draft
    else:
        device = torch.device("cpu")
    trainer = Trainer(targs, device)
    log.info("device %s, %d thread(s), batch tokens %d (rows padded to %s), ttt steps %d, %d warm-up + 2 x %d steps",
             device, threads, targs.batch_tokens, trainer.pad_to, targs.ttt_steps, ours.warmup, ours.steps)

    warm = PhaseClock(device)
    with closing(trainer.stream(0)) as stream:
        warmup_ms = []
        for _ in range(ours.warmup):
            t = trainer.sync()
            trainer.step(stream, warm)
            warmup_ms.append(round((trainer.sync() - t) * 1000, 1))
    log.info("warm-up step ms: %s", warmup_ms)

    unprofiled = run_steps(trainer, ours.steps, ours.warmup, NoClock())
    clock = PhaseClock(device)
    profiled = run_steps(trainer, ours.steps, ours.warmup, clock)
    phases = phase_table(clock.ms)
    result = {
        "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "torch": torch.__version__, "threads": threads, "row_loader": targs.row_loader, "batch_tokens": targs.batch_tokens,
        "row_length": trainer.pad_to, "ttt_steps": targs.ttt_steps, "warmup": ours.warmup, "steps": ours.steps,
        "warmup_step_ms": warmup_ms, "phases": phases, "profiled": profiled, "unprofiled": unprofiled,
    }
    print(f"\n{'phase':<14}{'ms/step (median)':>18}{'share %':>10}")
    for name, v in phases.items():
        print(f"{name:<14}{v['median_ms']:>18.3f}{v['share_pct']:>10.2f}")
    for name in ("profiled", "unprofiled"):
        r = result[name]
        print(f"{name:<14}{r['ms_per_step']:>18.3f} ms/step{r['tokens_per_s']:>14.0f} tok/s")
    print(f"warm-up steps (compile in the first): {warmup_ms} ms")
    write_json(Path(ours.json), result)  # the step's figures are kept whatever happens below

    def side(name: str, measure) -> None:
        """A side measurement; its failure is logged and recorded, the figures before it stay."""
        try:
            result[name] = measure()
        except Exception as e:  # one run on a lent GPU: keep going, report it
            log.exception("%s failed", name)
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        write_json(Path(ours.json), result)

    side("row_packing", lambda: packing_ms(trainer, min(ours.steps, 20), ours.warmup))
    if "error" not in result["row_packing"]:
        rp = result["row_packing"]
        rp["to_device_gb_per_s"] = round(rp["row_bytes"] / max(phases["to_device"]["median_ms"], 1e-6) / 1e6, 2)
        print(f"row packing without prefetch: {rp['median_ms']:.3f} ms/row ({rp['row_bytes']:,} bytes); "
              f"host to device {rp['to_device_gb_per_s']:.2f} GB/s")
    side("loss_in_forward", lambda: loss_part_ms(trainer, ours.warmup, reps=min(ours.steps, 10)))
    if "error" not in (lp := result["loss_in_forward"]):
        print(f"loss inside the forward (no-grad estimate): {lp['loss_ms']:.3f} of "
              f"{lp['forward_with_loss_ms']:.3f} ms")
    if not ours.no_eval:
        def eval_passes() -> list[dict]:
            evaluation = Evaluation(trainer.manifest, "eval", targs.model, targs.context_buckets,
                                    targs.trust_remote_code, device)
            return [eval_pass_ms(trainer, evaluation) for _ in range(2)]  # the first compiles the eval shapes

        side("eval_passes", eval_passes)
        for i, ev in enumerate(result["eval_passes"] if isinstance(result["eval_passes"], list) else []):
            print(f"eval pass {i + 1}: {ev['ms']:.1f} ms (acceptance length {ev['acceptance_length']})")
    if ours.torch_profiler:
        side("torch_profiler", lambda: torch_profile(trainer, Path(ours.torch_profiler), ours.warmup))
        if "error" not in result["torch_profiler"]:
            print(result["torch_profiler"]["table"])
    return result


if __name__ == "__main__":
    main()
