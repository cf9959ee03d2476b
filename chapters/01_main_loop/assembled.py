# %% [markdown]
# # 01 · The assembled trainer: one real run, line by line
#
# Every page so far built one part and tested it alone. `tinytron.train` is where they meet:
# one `torchrun` job that reads a TOML file, builds the process groups, the model, the gradient
# buffers, the optimizer, the scheduler and the data, resumes from the latest checkpoint if
# there is one, and runs this chapter's loop with chapter 08's safety nets until it saves and
# exits. It contains no mechanism of its own — it only wires — so reading one run of it is a
# tour of the book. This page runs the README's job once, shortened to eight iterations on two
# gloo ranks, and reads everything it prints and writes, naming for each line the chapter and
# the function that produced it.

# %%
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["repo_file", "trainer_command", "run_trainer", "read_log", "checkpoint_files"]

# %% [markdown]
# ## The wiring
#
# `tinytron.train.run` follows the order of Megatron's `pretrain`
# (`megatron/training/training.py:1029`): initialize, `setup_model_and_optimizer` (`:1938`:
# model, optimizer, scheduler, then `load_checkpoint`), build the data iterators *after* the
# load so that they start at the restored `consumed_train_samples`, train, save. Each box is a
# call into one chapter:
#
# ```mermaid
# flowchart TD
#   A["config: load_config + resolve(world)<br/>tinytron.config, checked before any process group"] --> B["grid: ParallelGrid(tp, pp, cp)<br/>appendix A"]
#   B --> C["model chunks: build_stage_models<br/>appendix B; recompute / offload: chapter 06"]
#   C --> D["DDP: contiguous grad buffer, buckets<br/>chapter 05"]
#   D --> E["optimizer: fp32 master weights, DistributedOptimizer<br/>chapter 02"]
#   E --> F["scheduler: OptimizerParamScheduler<br/>chapter 02"]
#   F --> G["load: latest checkpoint, any layout<br/>chapter 03"]
#   G --> H["data: .bin/.idx, GPTDataset, sampler at consumed samples<br/>chapter 04"]
#   H --> I["loop: pretrain / train / train_step, schedules, training_log<br/>chapter 01; nets, timers, logs: chapter 08"]
#   I -->|every save_interval and at the end| J["save: torch_dist, (async)<br/>chapter 03"]
#   I -->|every eval_interval| K["evaluate<br/>chapter 01"]
# ```
#
# The same wiring runs the book's running example. `configs/tiny.toml` is its CPU-sized
# cousin; the arithmetic that decides the number of micro-batches is the same:
#
# | | `tiny.toml` on 2 CPU ranks | `llama7b_tp2_pp2_dp64.toml` on 256 GPUs |
# |---|---|---|
# | model | $h$ 128, $L$ 4, 4 heads / 2 KV, $s$ 128 | $h$ 4096, $L$ 32, 32 heads / 8 KV, $s$ 4096 |
# | layout | TP1 · PP1 · CP1 · DP2 | TP2 (SP) · PP2 · CP1 · DP64 |
# | micro-batch $b$, global batch $B$ | 8, 32 | 2, 1024 |
# | micro-batches $m = B / (b \cdot d)$ | $32 / (8 \cdot 2) = 2$ | $1024 / (2 \cdot 64) = 8$ |
# | tokens per step $B \cdot s$ | 4,096 | 4,194,304 |
#
# The config files live at the repository's root; `repo_file` finds them from the installed
# package.

# %%
def repo_file(relative: str) -> Path:
    """A file of the repository (configs/tiny.toml, ...), found from the editable install."""
    import tinytron

    path = Path(tinytron.__file__).resolve().parent.parent / relative
    if not path.is_file():
        raise FileNotFoundError(f"{relative} not found at {path} (is tinytron installed "
                                f"editable from a checkout, pip install -e .?)")
    return path

# %% [markdown]
# ## The config
#
# A run is one TOML file whose sections are the chapters' config dataclasses under Megatron's
# names: `[model]` is appendix B's `ModelConfig`, `[optimizer]` chapter 02's
# `OptimizerConfig`, `[ddp]` chapter 05's `DistributedDataParallelConfig`, `[checkpoint]`
# chapter 03's, `[logging]` and `[reliability]` chapter 08's; `[parallel]` and `[training]`
# belong to `tinytron.config`. `load_config` type-checks every key against its dataclass
# (an unknown key is an error that suggests the nearest name) and `resolve(world_size)` cuts
# the layout — $d = \text{world} / (t \cdot p \cdot c)$, heads divisible by $t$, $B$ divisible
# by $b \cdot d$ — all before a single process group exists.

# %%
if __name__ == "__main__":
    from tinytron.config import load_config

    tiny_path = repo_file("configs/tiny.toml")
    print(tiny_path.read_text())
    layouts = {}
    for name, world in [("tiny", 2), ("llama7b_tp2_pp2_dp64", 256)]:
        cfg = load_config(repo_file(f"configs/{name}.toml")).resolve(world)
        tp, pp, vpp, cp = cfg.parallel.sizes()
        dp = cfg.data_parallel_size(world)
        m = cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)
        layouts[name] = (tp, pp, cp, dp, m)
        print(f"{name:>22}: world {world} = tp {tp} · pp {pp} · cp {cp} · dp {dp}; "
              f"m = {cfg.training.global_batch_size} / ({cfg.training.micro_batch_size} · {dp}) "
              f"= {m} micro-batches; {cfg.training.global_batch_size * cfg.model.seq_length:,} "
              f"tokens per step")
    assert layouts == {"tiny": (1, 1, 1, 2, 2), "llama7b_tp2_pp2_dp64": (2, 2, 1, 64, 8)}

# %% [markdown]
# ## One real run
#
# The README's command is `torchrun --nproc-per-node 2 -m tinytron.train --config
# configs/tiny.toml`. Dotted overrides shorten it without editing the file: eight iterations,
# a log record every two, an evaluation and a save every four, the checkpoint in a temporary
# directory. `--standalone` lets torchrun pick a free port. Everything else — the embedded
# corpus tokenized into a `.bin/.idx` on first use, the DistributedOptimizer, the overlapped
# gradient reduce, the cosine schedule — is what the full job does.

# %%
def trainer_command(config: str | Path, nproc: int, overrides: list[str] = ()) -> list[str]:
    """The torchrun command line of one trainer job on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "tinytron.train", "--config", str(config),
            *overrides]


def run_trainer(config: str | Path, nproc: int, overrides: list[str] = (),
                timeout: float = 300) -> str:
    """Run the trainer under torchrun; its console output (stdout and stderr, in order)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(trainer_command(config, nproc, overrides), env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"tinytron.train exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    # torchrun's own notices (glog-style "W1130 10:40:10 ..." lines and the OMP_NUM_THREADS
    # banner) are not the trainer's output
    return "\n".join(line for line in proc.stdout.splitlines() if line.strip()
                     and not re.match(r"[WIE]\d{4} |\*{5}|Setting OMP_NUM_THREADS", line))

# %%
if __name__ == "__main__":
    run_dir = Path(tempfile.mkdtemp(prefix="tinytron_run_")) / "tiny"
    overrides = ["--training.train_iters", "8", "--training.log_interval", "2",
                 "--training.eval_interval", "4", "--training.eval_iters", "1",
                 "--training.save_interval", "4", "--scheduler.lr_warmup_iters", "2",
                 "--checkpoint.save", str(run_dir)]
    t0 = time.perf_counter()
    console = run_trainer(repo_file("configs/tiny.toml"), 2, overrides)
    print(console)
    print(f"({time.perf_counter() - t0:.1f} s, torchrun start-up and corpus tokenizing included)")
    assert console.startswith("tinytron.train: world 2 = tp 1 · pp 1 · cp 1 · dp 2 on cpu")

# %% [markdown]
# ## Where each line comes from
#
# The console shows one line per log record; the files hold the rest. Every item below was
# produced by a function of the book, called by the wiring above:
#
# | what the run shows | produced by | page |
# |---|---|---|
# | `tinytron.train: world 2 = tp 1 · pp 1 · cp 1 · dp 2 on cpu` | `TrainConfig.resolve` checks the layout; `ParallelGrid(tp, pp, cp)` builds the groups | [grid](../parallel/grid.py) |
# | `memory per rank, predicted by chapter 07`: weights, grad buffer, master params, optimizer state, activations | `stage_ledgers(memory_config_from(cfg, world))`; with the DistributedOptimizer on DP2 the fp32 run's masters are views of its weights (no bytes) and the Adam moments are halves (3.1 MiB for 3.1 MiB of weights) | [ledger](../07_memory/ledger.py), [calculator](../07_memory/calculator.py) |
# | `wrote …/stdlib_400_byte_text_document.bin/.idx: 400 documents, 5,035,647 tokens` | `prepare_embedded_corpus` → `preprocess` with the byte tokenizer and EOD appended, once per output directory | [preprocess](../04_data/preprocess.py), [indexed](../04_data/indexed.py) |
# | `data/cache/…-GPTDataset-train-{document,sample,shuffle}_index.npy` | `GPTDataset`'s three indices, built once and memory-mapped; the sampler starts at `consumed_train_samples` | [gpt_dataset](../04_data/gpt_dataset.py), [samplers](../04_data/samplers.py) |
# | `[###----] 1/8` … `ETA 0:00:04` | `ProgressBar.render`: iteration / `train_iters`; ETA = iterations left × ms per iteration | [observability](../08_reliability/observability.py) |
# | `lm loss 5.9589` | the per-token vocab-parallel cross entropy; `lm_loss_func`'s `[sum, count]` pair; `reduce_losses` over micro-batches and DP; `training_log`'s mean over the interval | [vocab_parallel](../parallel/vocab_parallel.py), [loss](../00_overview/loss.py), [loop](loop.py), [training_log](training_log.py) |
# | `lr 1.50e-03` | `OptimizerParamScheduler`: linear warm-up to 3e-3 over 2 iterations, cosine to 3e-4 at iteration 8 | [scheduler](../02_optimizer/scheduler.py) |
# | `5.9k tok/s` | `training_log`: the interval's tokens ($B \cdot s$ per iteration) over its wall time | [training_log](training_log.py) |
# | `MFU: not reported on CPU`; JSONL `tflops_per_device` | `num_floating_point_operations` per iteration / time; MFU divides that by `peak_flops_per_device`, a GPU's datasheet peak (a CPU has none that holds: a one-shape matmul rate moves with load, and runs beat it) | [training_log](training_log.py) |
# | `rss 0.48 GiB` | `memory_report`: the process's resident set on a CPU (`allocated …`, the caching allocator's tensor bytes, on a GPU) | [observability](../08_reliability/observability.py) |
# | JSONL `grad_norm` | the global L2 norm before clipping to `clip_grad` (`get_grad_norm_fp32`, over the DistributedOptimizer's shards) | [mixed_precision](../02_optimizer/mixed_precision.py), [distributed](../02_optimizer/distributed.py) |
# | JSONL `loss_scale`, `skipped_iterations`, `nan_iterations` | the loss scaler (1.0 outside fp16) and `training_log`'s counts of skipped and NaN iterations | [mixed_precision](../02_optimizer/mixed_precision.py), [training_log](training_log.py) |
# | JSONL `{"iteration": 4, "validation": …}` | `evaluate` every `eval_interval`; no console line (the bar shows training) | [loop](loop.py) |
# | `iter_0000004/`, `iter_0000008/`: `__0_0.distcp`, `__1_0.distcp`, `.metadata`, `common.pt`, `metadata.json` | the `torch_dist` save: every rank writes its shards, rank 0 the index, the common state and `metadata.json` last | [torch_dist](../03_checkpoint/torch_dist.py) |
# | `latest_checkpointed_iteration.txt` = `8` | the tracker, written when a checkpoint is complete; the next start resumes from it | [formats](../03_checkpoint/formats.py), [resume](../03_checkpoint/resume.py) |
# | `result_rejected_tracker.txt` (empty) | the rerun state machine's record of rejected results: none | [rerun_state_machine](../08_reliability/rerun_state_machine.py) |
# | `log.jsonl`, `tensorboard/` | `MetricsLogger` on the last rank, with Megatron's scalar names | [observability](../08_reliability/observability.py) |
# | `config.toml` | `TrainConfig.to_toml()`: the resolved config, overrides and defaults included | `tinytron.config` |
# | `loss.png`; the `resume`, `tinytron-convert`, `tensorboard` lines | `plot_loss_curve` and the closing hints of `tinytron.train` | [convert](../03_checkpoint/convert.py) |
#
# Every JSONL record carries a `type`: `start` (written by each launch once its checkpoint is
# loaded: the iteration, the directory it resumed from, the world size), `train` or
# `validation`. Two small readers turn the files into Python objects; the log reader keeps
# the training and the validation records.

# %%
def read_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """The JSONL log as (training records, validation records), in file order."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    kind = [r.get("type", "validation" if "validation" in r else "train") for r in records]
    return ([r for r, k in zip(records, kind) if k == "train"],  # a launch's "start" is neither
            [r for r, k in zip(records, kind) if k == "validation"])


def checkpoint_files(save_dir: str | Path) -> dict:
    """{"latest": tracker iteration, iteration: sorted file names of iter_NNNNNNN/, ...}."""
    save_dir = Path(save_dir)
    out: dict = {"latest": int((save_dir / "latest_checkpointed_iteration.txt").read_text())}
    for d in sorted(save_dir.glob("iter_*")):
        out[int(d.name[len("iter_"):])] = sorted(p.name for p in d.iterdir())
    return out

# %% [markdown]
# ## Reading the run back
#
# The claims the table makes can be checked against the files. The learning rate follows the
# warm-up-then-cosine formula of chapter 02 exactly, with $\eta_{max} = 3 \cdot 10^{-3}$,
# $\eta_{min} = 3 \cdot 10^{-4}$, warm-up $w = 2$ and decay length $T = 8$:
# $\eta_i = \eta_{max} \, i / w$ for $i \le w$, else
# $\eta_{min} + (\eta_{max} - \eta_{min}) \tfrac12 \bigl(1 + \cos \pi \tfrac{i - w}{T - w}\bigr)$.
# Tokens per second times seconds per iteration is the global batch in tokens,
# $32 \cdot 128 = 4096$; the consumed samples grow by $B = 32$ per iteration; a record is
# written at the first iteration and every `log_interval` after it.

# %%
if __name__ == "__main__":
    import math

    import matplotlib.pyplot as plt

    train, valid = read_log(run_dir / "log.jsonl")
    print(f"{'iter':>4} {'lm loss':>8} {'lr':>9} {'grad norm':>9} {'tok/s':>7} {'TFLOP/s':>8} "
          "samples")
    for r in train:
        print(f"{r['iteration']:>4} {r['losses']['lm loss']:>8.4f} {r['learning_rate']:>9.2e} "
              f"{r['grad_norm']:>9.3f} {r['tokens_per_second']:>7.0f} {r['tflops_per_device']:>8.4f} "
              f"{r['consumed_train_samples']}")
    for r in valid:
        print(f"{r['iteration']:>4} validation lm loss {r['validation']['lm loss']:.4f}")
    files = checkpoint_files(run_dir)
    print("checkpoints:", files)

# %% [markdown]
# The two losses and the learning rate against the iteration: warm-up for two iterations,
# then the cosine down to $\eta_{min}$ at iteration 8.

# %%
if __name__ == "__main__":
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([r["iteration"] for r in train], [r["losses"]["lm loss"] for r in train], "o-",
            label="train lm loss")
    ax.plot([r["iteration"] for r in valid], [r["validation"]["lm loss"] for r in valid], "s",
            label="validation lm loss")
    ax.set_xlabel("iteration"), ax.set_ylabel("loss")
    lr_ax = ax.twinx()
    lr_ax.plot([r["iteration"] for r in train], [r["learning_rate"] for r in train], ":",
               color="gray", label="learning rate")
    lr_ax.set_ylabel("learning rate")
    fig.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The checks, one per claim above: which iterations logged and evaluated, the learning rate by
# the formula, tokens per iteration, consumed samples, the checkpoint files and the saved config.

# %%
if __name__ == "__main__":
    def lr_at(i, lr_max=3e-3, lr_min=3e-4, warmup=2, total=8):
        if i <= warmup:
            return lr_max * i / warmup
        progress = (i - warmup) / (total - warmup)
        return lr_min + (lr_max - lr_min) * 0.5 * (1 + math.cos(math.pi * progress))

    assert [r["iteration"] for r in train] == [1, 2, 4, 6, 8]     # one record per logged iteration
    assert [r["iteration"] for r in valid] == [4, 8]               # eval_interval 4
    assert train[-1]["losses"]["lm loss"] < train[0]["losses"]["lm loss"] - 0.5   # it learns
    for r in train:
        assert abs(r["learning_rate"] - lr_at(r["iteration"])) < 1e-9
        tokens = r["tokens_per_second"] * r["ms_per_iteration"] / 1e3
        assert abs(tokens - 32 * 128) < 1e-6 * 4096
        assert r["consumed_train_samples"] == 32 * r["iteration"]
    assert files["latest"] == 8 and sorted(k for k in files if k != "latest") == [4, 8]
    for it in (4, 8):
        expected = {"__0_0.distcp", "__1_0.distcp", ".metadata", "common.pt", "metadata.json"}
        assert set(files[it]) == expected   # Megatron-Core's file set, nothing more
    saved = load_config(run_dir / "config.toml").resolve(2)   # the config travels with the run
    assert saved.training.train_iters == 8
    assert saved.to_toml() == (run_dir / "config.toml").read_text()

# %% [markdown]
# The saved `config.toml` loads back into the same resolved config, so a checkpoint directory
# says how it was made; the checksums name every file with its size, so a copy can be checked
# before it is loaded. Rerunning the printed `resume` command loads `iter_0000008` and has
# nothing left to do. To train on, say to iteration 16, add `--training.train_iters 16` *and*
# `--scheduler.override_opt_param_scheduler true`: the scheduler saved in the checkpoint
# decays over 8 iterations, and chapter 02's `load_state_dict` refuses a different decay length
# unless told which one wins (Megatron's rule). The run then continues at iteration 9 with the
# sampler at sample 256 and the cosine stretched to 16 iterations.

# %% [markdown]
# ## Where MoE, FP8 and Transformer Engine would enter this iteration
#
# tinytron implements none of the three; none changes the loop's shape, and each enters at
# calls this page traced: MoE in each layer's MLP (a router and two all-to-alls per layer and
# direction), in the loss and in the expert weights' own gradient buffers; FP8 in every linear
# layer's matmul and in the optimizer's write-back; Transformer Engine in the layer spec.
#
# <details><summary>Megatron detail: where each one enters, file by file</summary>
#
# | feature | where it enters the iteration | what it changes there | Megatron at e03878b5f |
# |---|---|---|---|
# | MoE with expert parallelism | the MLP of each layer (inside `forward_step`) | a router picks top-$k$ experts per token; an all-to-all sends tokens to the EP ranks that hold them and back — two collectives per layer in forward, two in backward | `megatron/core/transformer/moe/moe_layer.py:213`, `megatron/core/transformer/moe/router.py:138`, `megatron/core/transformer/moe/token_dispatcher.py:354` |
# | | the loss and the schedule | a load-balancing auxiliary loss, scaled by the schedule like the main loss | `megatron/core/pipeline_parallel/schedules.py:327-330` |
# | | DDP and the optimizer (chapters 05, 02) | expert weights get buffers of their own, reduced over the expert-data-parallel group, not the whole DP group | `megatron/core/distributed/distributed_data_parallel.py:208` |
# | FP8 | every linear layer's matmul in forward and backward | inputs and weights cast to FP8 with per-tensor (or block) scales; the delayed recipe keeps an amax history per tensor, wrapped around the whole block | `megatron/core/transformer/transformer_block.py:597`, `megatron/core/fp8_utils.py:614` |
# | | the optimizer step and the param all-gather | fp32 masters stay; the distributed optimizer can write the new weights straight to FP8 shards and all-gather those | `megatron/core/optimizer/distrib_optimizer.py:2752`, `megatron/core/fp8_utils.py:484` |
# | Transformer Engine | the layer spec (appendix B's model) | fused TE modules replace norm + linear, the attention kernel and the row-parallel linear; TE is also where FP8 runs | `megatron/core/extensions/transformer_engine.py:989`, `:1583`, `megatron/core/models/gpt/gpt_layer_specs.py:351` |
#
# </details>

# %% [markdown]
# ## Summary
#
# - `tinytron.train` is wiring only: config → grid → model chunks → DDP → optimizer →
#   scheduler → load → data → loop → save, in the order of Megatron's `pretrain`, each step a
#   call into one chapter.
# - The whole layout is checked before a process group exists; the resolved config is printed,
#   saved with the run and reloadable.
# - Every number of the log has one producer: the loss contract (00), the loop and its
#   `training_log` (01), the optimizer and scheduler (02), the memory ledger (07), the
#   observability layer (08); every file has one writer: the data pipeline (04), the
#   `torch_dist` save and its tracker (03), the logger and the rerun machine (08).
# - [01.13](host_syncs.py) asks the same job where it waits for the device.
#
# ## How production does it
#
# - Megatron-LM: `pretrain_gpt.py` passes its providers to `pretrain`
#   (`megatron/training/training.py:1029`), which runs `initialize_megatron`, then
#   `setup_model_and_optimizer` (`:1938`: `get_model` `:1622`, `get_megatron_optimizer`,
#   `get_optimizer_param_scheduler` `:1827`, `load_checkpoint`), builds the data iterators and
#   calls `train` (`:3065`); the flags live in `megatron/training/arguments.py`, and its
#   `validate_args` is the counterpart of `TrainConfig.resolve`. Launch is `torchrun` per node,
#   usually from a Slurm script (`scripts/slurm_train.sh` here).
# - torchtitan: one `Trainer` (`torchtitan/trainer.py`) built from a TOML job config
#   (`torchtitan/models/llama3/train_configs/llama3_8b.toml`) with dotted command-line
#   overrides, the same shape as `tinytron.config`.
#
# ## Exercises
#
# 1. Run `configs/tp2_pp2.toml` on 4 ranks. Which lines of the console change, and why does
#    the memory report now print two stages with different activation totals?
#
#    <details><summary>Hint</summary>
#
#    Look for the lines that name the layout (TP, PP, DP sizes
#    and $m$) and the per-stage ones. Under 1F1B stage $r$ holds up to $p - r$ micro-batches'
#    activations ([01.4](pipeline_orders.py)), so with $p = 2$ stage 0 keeps two and stage 1
#    one; the stages also hold different layers (embedding on the first, head and loss on the
#    last).
#
#    </details>
#
# 2. Interrupt a run with Ctrl-C after iteration 5 (the config sets `exit_signal_handler`).
#    Which checkpoint does the printed resume command start from, and which samples does it
#    read first?
#
#    <details><summary>Answer</summary>
#
#    The handler only records the signal: the iteration in
#    flight finishes, then `checkpoint_and_decide_exit` sees it, saves and exits. Stopped after
#    iteration 5, that is `iter_0000005`, with `consumed_train_samples` $= 5 \cdot 32 = 160$;
#    the resumed run builds its data iterator after the load, so its first batch is samples
#    160-191. (A Ctrl-C that lands during iteration 6 saves `iter_0000006` and resumes at
#    sample 192.)
#
#    </details>
#
# 3. Add `--training.save_interval 1` and open TensorBoard: how does `save-checkpoint-time`
#    compare with `forward-backward-time`, and what changes with `--checkpoint.async_save true`?
#
#    <details><summary>Hint</summary>
#
#    This is a measurement on your machine. With a synchronous
#    save every iteration the save's time adds to each step; with `async_save` the save returns
#    early and its work goes on in the background, finished by `before_optimizer_step_fn` and
#    `finalize_async_save_fn` in a later iteration ([01.2](run.py), and chapter 03's page on
#    saving in the background).
#
#    </details>
