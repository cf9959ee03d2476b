"""The assembled trainer's cost per iteration: tinytron.train vs a plain PyTorch loop and torch DDP.

Two comparisons, each run side by side in this one script, alternating round by round so that
machine noise hits both alike; ratios are medians of per-round ratios.

- ``single`` (one process, one thread): ``tinytron.train.run`` in-process — the whole trainer:
  config, grid, chapter 05's DDP buffer, chapter 02's optimizer (DistOpt off) and scheduler,
  chapter 04's GPTDataset over the embedded corpus, chapter 01's loop with chapter 08's nets,
  timers, progress bar, JSONL and TensorBoard logs, chapter 03's checkpoint at the end — versus
  a plain loop over the same GPTDataset samples and the same model (``GPTModel`` forward with
  labels, masked mean loss, backward, ``clip_grad_norm_(foreach=True)``,
  ``torch.optim.AdamW(foreach=True)``). Goal: trainer / plain <= 1.03.
- ``independent`` (both parts): benchmarks/plain_llama.py, a Llama of the same shape and init
  scheme written with torch modules only (its own RMSNorm, rotate-half RoPE, SDPA
  ``is_causal``, SwiGLU, ``F.cross_entropy``, ``AdamW(foreach=True)``,
  ``clip_grad_norm_(foreach=True)``; under torch DDP for dp2), fed consecutive windows of the
  same token file by ``numpy.memmap``. The ``plain`` loop runs tinytron's own GPTModel, so the
  model's cost cancels out of trainer / plain; trainer / independent includes it. Goal:
  trainer / independent <= 1.00 (``ratio_over_independent``).
- ``dp2`` (two gloo ranks through ``run_on_ranks``): the trainer at DP2 versus
  ``torch.nn.parallel.DistributedDataParallel`` (``no_sync`` on all but the last micro-batch)
  on the same model and each rank's same samples, in tokens/s. Goal: trainer / DDP >= 1.0.

The trainer's time per iteration is taken as a difference, so that its start-up (building the
model, the dataset indices, the final checkpoint save, the loss plot) cancels:
``(t(2 + K iterations) - t(2 iterations)) / K``, in wall time and in this process's CPU time.
The plain loop times K iterations after 2 warm-up ones. Every measurement runs in a fresh
world (``run_on_ranks``, also for one rank) after an untimed warm-up, so no side inherits
another's state. Both clocks are reported; with one thread per process the CPU-time ratio is
the robust one on a loaded machine.
``--variants`` also times the trainer with per-iteration logging and without chapter 08's
result checks, to show what those cost; ``--profile`` splits one trainer iteration by source
area (Python self time under cProfile, the same difference of two runs).

``--keep-freed-memory`` runs every side with glibc keeping freed memory (``keep_freed_memory``).

Run: python benchmarks/bench_train.py [--rounds 5] [--iters 4] [--part single|dp2|both]
                                      [--variants] [--profile] [--shape bench|tiny]
                                      [--keep-freed-memory]
Writes benchmarks/results/train.json (train_tiny.json for --shape tiny: configs/tiny.toml's
model, micro-batch 8, global batch 32).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))   # plain_llama, here and in workers


def _tiny_toml_shape() -> tuple[dict, int, dict]:
    """configs/tiny.toml's [model] and batch sizes, read from the file the README runs."""
    import tomllib

    with open(Path(__file__).resolve().parent.parent / "configs" / "tiny.toml", "rb") as f:
        raw = tomllib.load(f)
    gbs = raw["training"]["global_batch_size"]
    return dict(raw["model"]), raw["training"]["micro_batch_size"], {1: gbs, 2: gbs}


SHAPES = {  # name -> model, micro-batch size, {world: global batch}
    "bench": (dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2,
                   ffn_hidden_size=688, vocab_size=512, seq_length=256),
              4, {1: 8, 2: 16}),    # 2 micro-batches per rank in both parts
    "tiny": _tiny_toml_shape(),
}
MODEL, MBS, GBS = SHAPES["bench"]


def use_shape(name: str) -> None:
    """Make SHAPES[name] the shape every function below runs (called in each worker too)."""
    global MODEL, MBS, GBS
    MODEL, MBS, GBS = SHAPES[name]

LR, WD, CLIP, WARMUP_ITERS = 1e-3, 0.1, 1.0, 2


def keep_freed_memory() -> None:
    """Make glibc's malloc keep freed memory in the process (``--keep-freed-memory``).

    By default glibc hands large freed blocks back to the kernel (``munmap`` above
    M_MMAP_THRESHOLD, a trim of the heap's top above M_TRIM_THRESHOLD), and the next tensor of
    that size faults its pages in again, zeroed, in the first kernel that writes it. With
    M_MMAP_MAX = 0 (``mallopt(-4, 0)``, ``malloc.h``) every block comes from the heap, and with
    M_TRIM_THRESHOLD at 1 GiB (``mallopt(-1, ...)``) the heap is not trimmed, so freed blocks
    stay mapped for reuse: what a caching allocator does, and CUDA's on a GPU. It changes no
    result, only where the time goes; applied to every side alike it shows how much of a gap
    is page faults.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    if not (libc.mallopt(-4, 0) and libc.mallopt(-1, 2 ** 30)):
        raise OSError("mallopt refused the thresholds")


VARIANTS = {  # name -> extra trainer sections; "trainer" is the default configuration
    "trainer": {},
    "trainer_log_every_iteration": {"training": {"log_interval": 1}},
    "trainer_no_result_checks": {"reliability": {"rerun_mode": "disabled",
                                                 "check_for_nan_in_loss_and_grad": False}},
}


# -- the two sides ----------------------------------------------------------------------------
def trainer_config(world: int, iters: int, out_dir: str, prefix: str, cache: str, extra=None):
    """The TrainConfig the trainer runs: MODEL, DistOpt off, no eval, one log record at the end."""
    from tinytron.config import TrainConfig

    raw = {"model": dict(MODEL),
           "training": {"micro_batch_size": MBS, "global_batch_size": GBS[world],
                        "train_iters": iters, "eval_interval": None, "log_interval": iters,
                        "seed": 1234, "device": "cpu"},
           "optimizer": {"lr": LR, "min_lr": LR, "weight_decay": WD, "clip_grad": CLIP,
                         "use_distributed_optimizer": False},
           "scheduler": {"lr_decay_style": "constant"},
           "ddp": {"overlap_grad_reduce": world > 1},
           "data": {"data_path": [prefix], "split": "98,2,0", "num_workers": 0,
                    "data_cache_path": cache},
           "checkpoint": {"save": out_dir}}
    for section, values in (extra or {}).items():
        raw.setdefault(section, {}).update(values)
    return TrainConfig.from_dict(raw).resolve(world)


def time_trainer(world: int, iters: int, prefix: str, cache: str, extra=None) -> dict:
    """Wall and CPU seconds of one whole tinytron.train.run, and its JSONL records."""
    import tinytron.train as train

    run = train.run
    out = tempfile.mkdtemp(prefix="bench_train_")
    cfg = trainer_config(world, iters, out, prefix, cache, extra)
    console = io.StringIO()
    dist.barrier()
    w0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
        code = run(cfg, [], "bench")
    dist.barrier()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    assert code == 0, console.getvalue()[-2000:]
    log = Path(out, "log.jsonl")
    records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    records = [r for r in records if "losses" in r]   # the training records (not start lines)
    return {"wall": wall, "cpu": cpu, "records": records}


def byte_tokenizer():
    """Chapter 04's byte tokenizer: the one that wrote the embedded corpus."""
    from tinytron.data.preprocess import TokenizerSpec, build_tokenizer

    return build_tokenizer(TokenizerSpec("byte", None))


class PlainLoop:
    """The reference: GPTModel, masked mean loss, backward, clip, AdamW(foreach), same samples."""

    def __init__(self, world: int, prefix: str, cache: str, ddp: bool, total_iters: int):
        from tinytron.data.pipeline import DataConfig, build_train_valid_test_datasets
        from tinytron.model import GPTModel, ModelConfig

        self.rank, self.world, self.m = dist.get_rank(), world, GBS[world] // (MBS * world)
        model = GPTModel(ModelConfig(**MODEL))
        self.params = list(model.parameters())
        self.model = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, foreach=True)
        data = DataConfig(data_path=[prefix], split="98,2,0", num_workers=0,
                          data_cache_path=cache)
        tok = byte_tokenizer()
        self.dataset = build_train_valid_test_datasets(
            data, MODEL["seq_length"], [total_iters * GBS[world], 0, 0], lambda: True,
            eod_id=tok.eod, pad_id=tok.pad if tok.pad >= 0 else tok.eod)[0]
        self.step_index = 0

    def _micro_batch(self, j: int) -> dict:
        """Micro-batch j of this step on this rank: Megatron's sampler order (dp-strided)."""
        start = self.step_index * GBS[self.world] + (j * self.world + self.rank) * MBS
        samples = [self.dataset[i] for i in range(start, start + MBS)]
        return {k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                for k in ("tokens", "labels", "loss_mask", "position_ids")}

    def step(self) -> float:
        """One optimizer step over m micro-batches; the global-batch token-mean loss."""
        self.opt.zero_grad(set_to_none=True)
        loss_sum, tokens = torch.zeros(()), torch.zeros(())
        for j in range(self.m):
            b = self._micro_batch(j)
            last = j == self.m - 1
            sync = contextlib.nullcontext() if last or self.world == 1 else self.model.no_sync()
            with sync:
                per_token = self.model(b["tokens"], b["position_ids"], labels=b["labels"])
                mask = b["loss_mask"].float()
                loss = (per_token * mask).sum() / mask.sum()
                (loss / self.m).backward()
            loss_sum += (per_token.detach() * mask).sum()
            tokens += mask.sum()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP, foreach=True)
        self.opt.step()
        self.step_index += 1
        if self.world > 1:  # the logged loss is the global batch's token mean, as the trainer's
            report = torch.stack([loss_sum, tokens])
            dist.all_reduce(report)
            loss_sum, tokens = report
        return float(loss_sum / tokens)

    def time(self, warmup: int, iters: int) -> dict:
        """Wall and CPU seconds per iteration over `iters` steps after `warmup` steps."""
        return time_steps(self.step, warmup, iters)


def time_steps(step, warmup: int, iters: int) -> dict:
    """Wall and CPU seconds per call of step() over `iters` calls after `warmup` calls."""
    first = [step() for _ in range(warmup)]
    dist.barrier()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        step()
    dist.barrier()
    return {"wall": (time.perf_counter() - w0) / iters,
            "cpu": (time.process_time() - c0) / iters, "first_loss": first[0]}


# -- one round of each side, on every rank ----------------------------------------------------
def trainer_per_iteration(world: int, iters: int, prefix: str, cache: str, extra=None) -> dict:
    """The trainer's seconds per iteration: (t(2 + iters) - t(2)) / iters, both clocks."""
    short = time_trainer(world, WARMUP_ITERS, prefix, cache, extra)
    long = time_trainer(world, WARMUP_ITERS + iters, prefix, cache, extra)
    own = long["records"][-1]["ms_per_iteration"] / 1e3 if long["records"] else None
    return {"wall": (long["wall"] - short["wall"]) / iters,
            "cpu": (long["cpu"] - short["cpu"]) / iters,
            "logged_wall": own,   # the trainer's own log: iterations 1..N, loop start-up included
            "first_loss": long["records"][0]["losses"]["lm loss"] if long["records"] else None}


class IndependentLoop:
    """The independent reference: benchmarks/plain_llama.py's model, step and data, no tinytron.

    Same shape, init scheme, optimizer settings and batch sizes; its samples are consecutive
    windows of the same token file (not GPTDataset's shuffled ones: the cost is the same).
    """

    def __init__(self, world: int, prefix: str):
        from plain_llama import PlainLlama, PlainTrainer, TokenWindows

        self.m = GBS[world] // (MBS * world)
        self.trainer = PlainTrainer(PlainLlama(**MODEL), LR, WD, CLIP, ddp=world > 1)
        self.data = TokenWindows(prefix, MODEL["seq_length"])
        self.data.next_window = dist.get_rank() * 10 ** 4   # each rank its own windows

    def step(self) -> float:
        loss = self.trainer.step([self.data.batch(MBS) for _ in range(self.m)])
        return float(loss)   # the step's one host sync, as a loop that logs its loss has

    def time(self, warmup: int, iters: int) -> dict:
        return time_steps(self.step, warmup, iters)


def measure_side(side: str, world: int, iters: int, prefix: str, cache: str,
                 shape: str = "bench", keep_memory: bool = False) -> dict:
    """One side's seconds per iteration, on each rank of a fresh world (run_on_ranks' worker).

    Fresh because every in-process trainer run leaves its gloo subgroups (8 per run, 3 threads
    each) behind, and a few dozen runs in one process cost measurable CPU.
    """
    use_shape(shape)
    if keep_memory:
        keep_freed_memory()
    torch.manual_seed(0)
    if side == "plain":
        loop = PlainLoop(world, prefix, cache, ddp=world > 1, total_iters=2 + WARMUP_ITERS + iters)
        first = loop.time(1, 1)["first_loss"]   # first steps pay lazy initialization: not timed
        return dict(loop.time(WARMUP_ITERS, iters), first_loss=first)
    if side == "independent":
        loop = IndependentLoop(world, prefix)
        first = loop.time(1, 1)["first_loss"]
        return dict(loop.time(WARMUP_ITERS, iters), first_loss=first)
    time_trainer(world, WARMUP_ITERS, prefix, cache, VARIANTS[side])   # imports: not timed
    return trainer_per_iteration(world, iters, prefix, cache, VARIANTS[side])


def run_rounds(world: int, rounds: int, iters: int, prefix: str, cache: str,
               variants: list[str], threads: int, shape: str = "bench",
               keep_memory: bool = False) -> list[dict]:
    """Per rank, {side: [per-round dict]}; the sides alternate within each round."""
    from tinytron.launch import run_on_ranks

    sides = [*variants, "plain", "independent"]
    out = [{side: [] for side in sides} for _ in range(world)]
    for _ in range(rounds):
        for side in sides:
            got = run_on_ranks(measure_side, world, side, world, iters, prefix, cache, shape,
                               keep_memory, timeout=900, num_threads=threads)
            for rank, r in enumerate(got):
                out[rank][side].append(r)
    return out


# -- what costs what: Python self time by source area, per iteration ---------------------------
AREAS = [("chapters/model", "model (appendix B)"),
         ("chapters/parallel", "model (appendix A layers)"),
         ("chapters/00_overview", "loss contract (00)"),
         ("chapters/01_main_loop", "loop, schedule, training_log (01)"),
         ("chapters/02_optimizer", "optimizer, scheduler (02)"),
         ("chapters/03_checkpoint", "checkpoint hooks (03)"),
         ("chapters/04_data", "data (04)"),
         ("chapters/05_buffers", "DDP buffers, hooks (05)"),
         ("chapters/08_reliability", "nets, timers, logging (08)"),
         ("chapters/train.py", "tinytron.train"),
         ("site-packages/torch", "torch Python"),
         ("~", "torch kernels and other builtins")]


def _self_time_by_area(stats) -> dict:
    """{area: seconds of self time} from a pstats.Stats."""
    out: dict = {}
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        path = filename.replace(os.sep, "/")
        area = next((name for key, name in AREAS
                     if (path == key if key == "~" else key in path)), "other")
        out[area] = out.get(area, 0.0) + tottime
    return out


def profile_breakdown(prefix: str, cache: str, iters: int) -> dict:
    """ms per iteration of each area: cProfile of t(2 + iters) minus t(2), over iters."""
    import cProfile
    import pstats

    time_trainer(1, WARMUP_ITERS, prefix, cache)   # imports, index caches: not profiled
    areas = []
    for n in (WARMUP_ITERS, WARMUP_ITERS + iters):
        prof = cProfile.Profile(time.process_time)  # CPU time: robust on a loaded machine
        prof.enable()
        time_trainer(1, n, prefix, cache)
        prof.disable()
        areas.append(_self_time_by_area(pstats.Stats(prof)))
    keys = sorted(set(areas[0]) | set(areas[1]), key=lambda k: -areas[1].get(k, 0.0))
    return {k: 1e3 * (areas[1].get(k, 0.0) - areas[0].get(k, 0.0)) / iters for k in keys}


# -- summaries ----------------------------------------------------------------------------------
def summarize(per_round: dict, tokens_per_step: int, variants: list[str]) -> dict:
    """Medians per side and median per-round ratios trainer variant / plain, for each clock."""
    out = {"seconds_per_iteration": {}, "ratio_over_plain": {}, "ratio_over_independent": {},
           "tokens_per_second": {}}
    for clock in ("wall", "cpu"):
        out["seconds_per_iteration"][clock] = {
            k: statistics.median(r[clock] for r in v) for k, v in per_round.items()}
        for ref in ("plain", "independent"):
            out[f"ratio_over_{ref}"][clock] = {
                name: statistics.median(a[clock] / b[clock] for a, b in
                                        zip(per_round[name], per_round[ref]))
                for name in [*variants, "plain"] if name != ref}
        out["tokens_per_second"][clock] = {
            k: tokens_per_step / s for k, s in out["seconds_per_iteration"][clock].items()}
    logged = [r["logged_wall"] for r in per_round["trainer"] if r["logged_wall"]]
    out["trainer_logged_seconds_per_iteration_median"] = (statistics.median(logged) if logged
                                                          else None)
    out["first_loss"] = {k: v[0]["first_loss"] for k, v in per_round.items()}
    return out


def prepare_data(workdir: str) -> tuple[str, str]:
    """The embedded corpus as .bin/.idx (the trainer's own preparation) and a shared index cache."""
    from tinytron.train import init_distributed, prepare_embedded_corpus

    init_distributed(torch.device("cpu"))
    prefix = prepare_embedded_corpus(os.path.join(workdir, "data"))
    return prefix, os.path.join(workdir, "data", "cache")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("single", "dp2", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=4, help="timed iterations per side and round")
    ap.add_argument("--variants", action="store_true",
                    help="also time the trainer logging every iteration and without result checks")
    ap.add_argument("--profile", action="store_true",
                    help="also break the trainer's iteration down by source area (cProfile)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench",
                    help="bench: h256 L4 s256 mbs 4; tiny: configs/tiny.toml's model and batch")
    ap.add_argument("--out", default=None,
                    help="default benchmarks/results/train.json (train_tiny.json for --shape tiny)")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="every side's process keeps freed memory mapped (see keep_freed_memory)")
    args = ap.parse_args()
    use_shape(args.shape)
    if args.out is None:
        args.out = str(Path(__file__).resolve().parent / "results" /
                       ("train.json" if args.shape == "bench" else f"train_{args.shape}.json"))
    torch.set_num_threads(args.threads)
    variants = list(VARIANTS) if args.variants else ["trainer"]
    command = "python benchmarks/bench_train.py " + " ".join(sys.argv[1:])
    result = {"command": command.strip(), "torch": torch.__version__,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
              "shared_machine_note": "a shared 2-core machine loaded by other jobs: absolute "
                                     "times are noisy; compare the side-by-side ratios",
              "threads_per_process": args.threads, "shape": args.shape, "model": MODEL, "micro_batch_size": MBS,
              "keep_freed_memory": args.keep_freed_memory,
              "load_average_before": os.getloadavg()}
    workdir = tempfile.mkdtemp(prefix="bench_train_data_")
    prefix, cache = prepare_data(workdir)
    seq = MODEL["seq_length"]
    if args.part in ("single", "both"):
        per_round = run_rounds(1, args.rounds, args.iters, prefix, cache, variants,
                               args.threads, args.shape, args.keep_freed_memory)[0]
        result["single"] = {"global_batch_size": GBS[1], "rounds": per_round,
                            **summarize(per_round, GBS[1] * seq, variants)}
        r = result["single"]["ratio_over_plain"]
        print(f"single process: trainer / plain loop over GPTModel = {r['cpu']['trainer']:.3f} "
              f"(CPU time), {r['wall']['trainer']:.3f} (wall); goal <= 1.03")
        r = result["single"]["ratio_over_independent"]
        print(f"single process: trainer / independent plain-PyTorch Llama = "
              f"{r['cpu']['trainer']:.3f} (CPU time), {r['wall']['trainer']:.3f} (wall); "
              f"GPTModel loop / independent = {r['cpu']['plain']:.3f} (CPU), "
              f"{r['wall']['plain']:.3f} (wall); goal <= 1.00")
    if args.profile:
        from tinytron.launch import run_on_ranks

        result["single_profile_ms_per_iteration"] = prof = run_on_ranks(
            profile_breakdown, 1, prefix, cache, args.iters, timeout=900,
            num_threads=args.threads)[0]
        print("trainer, ms per iteration by area (cProfile self time; profiling inflates "
              "Python):", {k: round(v, 1) for k, v in prof.items()})
    if args.part in ("dp2", "both"):
        ranks = run_rounds(2, args.rounds, args.iters, prefix, cache, variants, args.threads,
                           args.shape, args.keep_freed_memory)
        for name in variants:  # the trainer's log is written by the last rank
            for r0, r1 in zip(ranks[0][name], ranks[1][name]):
                r0["first_loss"], r0["logged_wall"] = r1["first_loss"], r1["logged_wall"]
        s = summarize(ranks[0], GBS[2] * seq, variants)
        s["tokens_per_second_ratio_trainer_over_ddp"] = {
            clock: 1 / s["ratio_over_plain"][clock]["trainer"] for clock in ("wall", "cpu")}
        s["tokens_per_second_ratio_trainer_over_independent_ddp"] = {
            clock: 1 / s["ratio_over_independent"][clock]["trainer"] for clock in ("wall", "cpu")}
        result["dp2"] = {"global_batch_size": GBS[2], "reference": "torch DDP (gloo), no_sync",
                         "rounds_rank0": ranks[0], "rounds_rank1": ranks[1], **s}
        r = s["tokens_per_second_ratio_trainer_over_ddp"]
        print(f"DP2 (gloo): trainer tokens/s / torch DDP tokens/s = {r['wall']:.3f} (wall), "
              f"{r['cpu']:.3f} (CPU time per rank); goal >= 1.0")
        r = s["tokens_per_second_ratio_trainer_over_independent_ddp"]
        print(f"DP2 (gloo): trainer tokens/s / independent Llama under torch DDP = "
              f"{r['wall']:.3f} (wall), {r['cpu']:.3f} (CPU time per rank)")
    result["load_average_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"load average {result['load_average_before']} -> {result['load_average_after']}")
    print(f"command: {result['command']}  -> {out}")


if __name__ == "__main__":
    main()
