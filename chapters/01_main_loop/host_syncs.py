# %% [markdown]
# # 01 · Host syncs: where an iteration waits for the device
#
# [01.12](assembled.py) ran the README's job and traced every number and file it produced
# back to the function that made it. This page asks the same job a question its log cannot
# answer: where does the host stop and wait for the device? It counts every such read of one
# iteration, by the function that makes it, names each with the Megatron line that makes the
# same read, and turns chapter 08's checks off to see which ones go.

# %%
from __future__ import annotations

from tinytron.main_loop.assembled import repo_file

__all__ = ["expected_host_reads"]

# %% [markdown]
# ## Why a read of a tensor costs a GPU
#
# On a GPU the host runs ahead: it queues kernels and returns at once, and the device works
# through the queue behind it. Every time the Python code asks a tensor for a value — an
# `.item()`, a `float(loss)`, an `if torch.isnan(norm):` — the host must stop until the device
# has caught up to that kernel, and the queue runs dry while it waits. A loop wants few of
# these *host syncs*, each of them on purpose. torchtitan names its own; the README's job can
# be asked for all of its.
#
# ## Counting them
#
# The instrument is `record_host_reads` (`chapters/01_main_loop/_host_reads.py`): inside a
# `with` block it replaces the seven `torch.Tensor` methods that hand a value to Python
# (`item`, `tolist`, `numpy`, `cpu`, `__bool__`, `__float__`, `__int__`) with counting
# wrappers, charging each call to the tinytron function that made it and to the function in
# another file that asked for it (a call from inside torch counts for the tinytron code that
# called torch). On this CPU the reads cost nothing, but they are the same calls at the same
# places as on a GPU, so the CPU run lists the GPU run's syncs. Two runs of the README's job
# from scratch, of 2 and 4 iterations, are recorded on each rank; their difference over 2 is
# what one iteration adds, with start-up, final save and final validation canceled out. A
# log record every iteration puts the logging reads in.

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.main_loop._host_reads import trainer_host_reads

    reads = run_on_ranks(trainer_host_reads, 2, str(repo_file("configs/tiny.toml")),
                         ["--training.log_interval", "1", "--scheduler.lr_decay_iters", "300"],
                         timeout=600)
    for (site, method), n in sorted(reads[0].items()):
        print(f"{n:4.0f} x {method:<9} {site}")

# %% [markdown]
# ## What one iteration reads
#
# Sorted by what each one costs on a GPU, with $m = 2$ micro-batches per rank, one gradient
# bucket and a world of 2 (the running example has $m = 8$):
#
# | per iteration | where | why | on a GPU |
# |---|---|---|---|
# | $2m$ | `result_checks.check_loss` → `validate_result` | the loss is NaN? Inf? (`pretrain_gpt.py:152-168`) | a sync per micro-batch |
# | 2 per bucket | `result_checks.check_grad_norms` | the bucket's local grad norm is NaN? Inf? before the collective (`param_and_grad_buffer.py:323-340`) | a sync per bucket |
# | 1 | `_reduce_any` in `train_step` | did any rank ask for a rerun? (`rerun_state_machine.py:262-269`) | a sync |
# | 1 | `get_grad_norm_fp32` | the norm the clip divides by (`clip_grads.py:142`) | a sync |
# | world | `signals_received` in `checkpoint_and_decide_exit` | did any rank get SIGTERM? (`training.py:2972`) | one sync, then copies |
# | 1 + 1 | `training_log` loss, timers' `.cpu()` | the log record's loss and every rank's times | a sync per log interval |
# | $4m$ | `get_batch`'s id checks (04) | token ids and labels within the vocabulary | none: host tensors, before the copy |
# | $m \cdot b$ | `GPTDataset` sample masks (04) | building each sample | none: the data loader's host work |
# | $4m$, $m$ | `GPTModel`'s id checks, `_default_positions` | the same checks on host inputs | none: skipped for device tensors |
#
# So on the last pipeline stage of the running example an iteration waits for its GPU
# $2 \cdot 8 + 2k + 3 = 19 + 2k$ times with $k$ gradient buckets, two more at a log record —
# each one a check Megatron makes at the same place, and none inside the model. Chapter 08's
# switches remove the checks: with `check_for_nan_in_loss_and_grad = false` and the rerun
# machine disabled, the loss checks, the bucket checks and the rerun vote go, as they must for
# the full-iteration CUDA graph, where no host read can run at all (the second run below).
# The demo's asserts state the table; `tests/test_main_loop_host_reads.py` checks the
# recorder itself and, on a GPU, that the model reads nothing.

# %%
def expected_host_reads(m: int, world: int, buckets: int, b: int) -> dict:
    """The table above as {(site, method): reads per iteration}, for m micro-batches of b."""
    checks = "08_reliability/rerun_state_machine.py:_initial_check <- 08_reliability/result_checks.py:"
    loop, rel = "01_main_loop/loop.py:", "08_reliability/"
    return {
        (checks + "check_loss", "__bool__"): 2 * m,
        (checks + "check_grad_norms", "__bool__"): 2 * buckets,
        (rel + "rerun_state_machine.py:_reduce_any <- " + loop + "train_step", "tolist"): 1,
        ("02_optimizer/mixed_precision.py:get_grad_norm_fp32 <- " + rel + "loop_hooks.py:wrapped",
         "__float__"): 1,
        (rel + "restarts.py:<listcomp> <- 01_main_loop/run.py:checkpoint_and_decide_exit",
         "item"): world,
        ("01_main_loop/training_log.py:<dictcomp> <- 01_main_loop/_parts.py:log_step",
         "__float__"): 1,
        (rel + "timers.py:all_ranks_seconds <- " + rel + "observability.py:_write_timers",
         "cpu"): 1,
        ("04_data/distribute.py:<genexpr> <- " + loop + "gpt_forward_step", "__int__"): 4 * m,
        ("04_data/gpt_dataset.py:_masks <- " + rel + "rerun_state_machine.py:__next__",
         "numpy"): m * b,
        ("model/_checks.py:<genexpr> <- model/gpt.py:_stage_input", "__int__"): 2 * m,
        ("model/_checks.py:<genexpr> <- model/gpt.py:_head", "__int__"): 2 * m,
        ("model/gpt.py:_default_positions <- 05_buffers/distributed_data_parallel.py:forward",
         "__bool__"): m,
    }

# %% [markdown]
# The recorded reads are exactly these, on both ranks:

# %%
if __name__ == "__main__":
    table = expected_host_reads(m=2, world=2, buckets=1, b=8)
    assert reads[0] == reads[1] == table, (reads[0], table)   # every read, on both ranks

# %% [markdown]
# ## With the checks off
#
# The same job with chapter 08's checks off reads the device three places fewer per iteration:

# %%
if __name__ == "__main__":
    off = run_on_ranks(trainer_host_reads, 2, str(repo_file("configs/tiny.toml")),
                       ["--training.log_interval", "1", "--scheduler.lr_decay_iters", "300",
                        "--reliability.check_for_nan_in_loss_and_grad", "false",
                        "--reliability.rerun_mode", "disabled"], timeout=600)
    gone = {key for key in table if key[0].endswith(("check_loss", "check_grad_norms",
                                                     "train_step"))}
    assert len(gone) == 3 and off[0] == off[1] == {k: n for k, n in table.items() if k not in gone}

# %% [markdown]
# Both runs side by side, one bar per place and method: the three checks that went are the
# three that cost a GPU a sync per micro-batch, per bucket or per step.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    def label(site: str, method: str) -> str:
        made, _, asked = site.partition(" <- ")
        name = made.rsplit(":", 1)[1]
        if name.startswith("<") or name == "_initial_check":  # a comprehension, a shared helper
            name = asked.rsplit(":", 1)[1]
        return f"{name} .{method}"

    sites = sorted(table, key=table.get)
    labels = [label(site, method) for site, method in sites]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.barh([k + 0.2 for k in range(len(sites))], [table[s] for s in sites], height=0.4,
            label="checks on")
    ax.barh([k - 0.2 for k in range(len(sites))], [off[0].get(s, 0) for s in sites],
            height=0.4, label="checks off")
    ax.set_yticks(range(len(sites)), labels, fontsize=7)
    ax.set_xlabel("reads per iteration on rank 0 (recorded), m = 2, b = 8")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Summary
#
# - A host read (`.item()`, `float`, `bool`, `.tolist()`, `.numpy()`, `.cpu()`) of a device
#   tensor is a host sync: the queue of kernels drains while Python waits.
# - One iteration of the README's job reads the device at 6 places on a GPU (loss and bucket
#   checks, the rerun vote, the grad norm, the exit signal, the log), each where Megatron reads
#   it; the model reads nothing, and the data pipeline's reads are of host tensors.
# - Chapter 08's switches remove the three checks, $2m + 2k + 1$ syncs per iteration.
#
# ## How production does it
#
# - Megatron-LM makes the same reads at the lines of the table: the loss check in
#   `pretrain_gpt.py:152-168`, the bucket check in
#   `megatron/core/distributed/param_and_grad_buffer.py:323-340`, the rerun vote in
#   `megatron/core/rerun_state_machine.py:262-269`, the grad norm in
#   `megatron/core/optimizer/clip_grads.py:142`, the exit signal in
#   `megatron/training/training.py:2972`.
# - PyTorch: `torch.cuda.set_sync_debug_mode("warn")` reports every sync on a GPU, those
#   inside one C++ operator too, which the recorder cannot see.
#
# ## Exercises
#
# 1. The running example's last stage with $k = 4$ gradient buckets: how many host syncs does
#    an iteration make, and at a log record? And with chapter 08's checks off?
#
#    <details><summary>Answer</summary>
#
#    $2m + 2k + 3 = 2 \cdot 8 + 2 \cdot 4 + 3 = 27$: the loss
#    checks, the bucket checks, the rerun vote, the grad norm and the exit signal; 29 at a log
#    record (its loss and the timers). With the checks off the loss checks ($2m = 16$), the
#    bucket checks ($2k = 8$) and the vote (1) go: 2 per iteration, 4 at a log record.
#
#    </details>
#
# 2. `torch.nonzero` on a device tensor waits for the device too. Why does the recorder not
#    count it, and how would you find such a sync on a GPU?
#
#    <details><summary>Hint</summary>
#
#    The recorder replaces seven methods of `torch.Tensor`; the
#    size of `nonzero`'s output is read inside one C++ operator, which never calls them. Read
#    the docstring of `chapters/01_main_loop/_host_reads.py` and PyTorch's
#    `torch.cuda.set_sync_debug_mode`.
#
#    </details>
