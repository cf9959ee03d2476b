# %% [markdown]
# # 00 · The big picture: one training step, from data to a weight update
#
# Every chapter of this book zooms into one box of a single picture: a batch of tokens goes in,
# a loss comes out, gradients flow back, and the optimizer moves the weights a little. This page
# draws that picture, then runs it once on a tiny model and prints what each box produced.
#
# What you will build: `one_step`, a training step that keeps every intermediate (tokens,
# logits, per-token loss, loss, gradient norm, update size) so you can look at them.

# %%
from __future__ import annotations

import torch

from tinytron.overview.loss import lm_loss_func, microbatch_objective

__all__ = ["one_step"]

# %% [markdown]
# ## The pipeline
#
# ```mermaid
# flowchart TB
#   D["dataset<br/>seq_length+1 tokens"] --> B["batch<br/>tokens, labels,<br/>masks, positions"]
#   B --> F["forward<br/>logits [b,s,V]"]
#   F --> L["per-token CE [b,s]<br/>× loss mask"]
#   L --> C["loss contract<br/>(loss_sum, num_tokens, report)"]
#   C --> K["backward<br/>grads accumulate"]
#   K --> R["finalize grads<br/>DP reduce, clip"]
#   R --> O["optimizer.step<br/>weights move"]
#   O -. next iteration .-> D
# ```
#
# In numbers, for the demo below: 2 samples of 16 tokens, a vocabulary of 262 byte-level ids,
# so the logits are $2 \times 16 \times 262$; at initialization every token is about equally
# likely, so the per-token loss starts near $\ln 262 \approx 5.57$. The loss is the masked mean
# $\sum_i \ell_i m_i / \sum_i m_i$; its gradient is clipped to norm 1 and AdamW's first step moves
# every weight by about the learning rate, whatever the gradient's scale.
#
# Megatron's version of each box: the dataset (`megatron/core/datasets/gpt_dataset.py:225`),
# `get_batch` and `loss_func` (`pretrain_gpt.py:76`, `:121`), the schedule that runs forward and
# backward per micro-batch (`megatron/core/pipeline_parallel/schedules.py:251`, `:494`),
# `finalize_model_grads` (`megatron/core/distributed/finalize_model_grads.py:445`) and the
# optimizer step inside `train_step` (`megatron/training/training.py:2162`).

# %% tags=["hide-input"]
def one_step(model, optimizer, batch: dict, clip_grad: float = 1.0) -> dict:
    """One pretraining step on one micro-batch that returns every intermediate for inspection."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    logits = model(batch["tokens"], batch.get("position_ids"),
                   attention_mask=batch.get("attention_mask"))
    v = logits.shape[-1]
    per_token = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, v), batch["labels"].reshape(-1), reduction="none"
    ).view(batch["labels"].shape)
    loss_sum, num_tokens, report = lm_loss_func(batch["loss_mask"], per_token)
    loss = microbatch_objective(loss_sum, num_tokens, 1, calculate_per_token_loss=False)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_grad)
    before = [p.detach().clone() for p in params]
    optimizer.step()
    deltas = [(p.detach() - b) for p, b in zip(params, before)]
    return {"logits": logits.detach(), "per_token_loss": per_token.detach(),
            "loss": float(loss.detach()), "num_tokens": int(num_tokens), "report": report,
            "grad_norm": float(grad_norm),
            "update_norm": float(torch.sqrt(sum((d ** 2).sum() for d in deltas))),
            "max_update": max(float(d.abs().max()) for d in deltas)}


# %% [markdown]
# ## The same step at the running example's size
#
# The book's running example (the [front page](../index.md)) is a Llama-3-8B-shaped model on
# 256 GPUs: tensor parallel 2, pipeline parallel 2, data parallel 64, micro-batch 2, global
# batch 1024, sequence 4096, vocabulary 128,256. The boxes above are the same; only their
# sizes change, and each size is the subject of a later chapter:
#
# ```mermaid
# flowchart TB
#   D["dataset<br/>1024 samples of 4097 tokens"] --> B["batch<br/>4,194,304 tokens per step"]
#   B --> M["m = 1024 / (2 · 64) = 8<br/>micro-batches per rank (01)"]
#   M --> F["forward, last stage<br/>logits [2, 4096, 64128] per TP rank"]
#   F --> K["backward<br/>fp32 grad buffer 8.03 GB per rank (05)"]
#   K --> O["optimizer.step<br/>masters + moments 0.38 GB: a 1/64 shard (02)"]
# ```
#
# | quantity | value | where it is worked out |
# |---|---|---|
# | tokens per step | $1024 \cdot 4096 = 4\,194\,304$ | chapter 01, the batch system |
# | micro-batches per rank and step | $1024 / (2 \cdot 64) = 8$ | chapter 01 |
# | logits per TP rank, one micro-batch | $2 \times 4096 \times 128\,256/2$, 2.1 GB in fp32 | chapter 00's loss, appendix A |
# | fp32 grad buffer of one pipeline stage's TP shard | 8,030,519,296 B = 8.03 GB | chapters 05 and 07 |
# | fp32 masters + Adam moments of its $1/64$ shard | 125,476,864 + 250,953,728 B = 0.38 GB | chapters 02 and 07 |
#
# The logits dominate a micro-batch's forward on the last stage: a vocabulary split over the
# TP ranks is why the loss is computed *vocab-parallel* rather than after a gather. The grad
# buffer is whole on every data-parallel rank (each rank accumulates all its gradients before
# the reduce-scatter), while the optimizer's state is split 64 ways; that asymmetry is the
# distributed optimizer's whole point. The last two rows are chapter 07's ledger
# (`tinytron-memory --config configs/llama7b_tp2_pp2_dp64.toml --world-size 256`); the demo
# below checks the first three by arithmetic.

# %% [markdown]
# ## Demo: one step on a tiny model

# %% tags=["hide-input"]
if __name__ == "__main__":
    import copy
    import math

    from tinytron.overview._tiny_model import build_demo_model
    from tinytron.overview.batch import ByteTokenizer, build_gpt_sample
    from tinytron.overview.loss import pretrain_forward_step, train_step

    torch.set_num_threads(1)
    tok = ByteTokenizer()
    text = "the cat sat on the mat.<eod>a dog ran far away."
    ids = [i for part in text.split("<eod>") for i in tok.encode(part) + [tok.eod]]
    stream = torch.tensor(ids[:33])
    samples = [build_gpt_sample(stream[k * 16: k * 16 + 17], tok.eod, tok.pad,
                                reset_position_ids=True, reset_attention_mask=True,
                                eod_mask_loss=True) for k in range(2)]
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    model, name = build_demo_model(vocab_size=tok.vocab_size, seq_length=16)
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    out = one_step(model, opt, batch)

# %% [markdown]
# Each printed line below is one box of the picture, in order: the tokens and the labels
# shifted by one, the logits, the per-token loss and its mask, the reduced loss, the gradient
# norm before clipping, and how far the weights moved.

# %% tags=["hide-input"]
if __name__ == "__main__":
    print(f"model            : {name}")
    print("1 tokens         :", [tok.decode(r) for r in batch["tokens"]])
    print("  labels         :", [tok.decode(r) for r in batch["labels"]])
    print("2 logits         :", tuple(out["logits"].shape), "argmax ids of row 0:",
          out["logits"][0].argmax(-1)[:8].tolist(), "...")
    print("3 per-token loss :", [round(x, 2) for x in out["per_token_loss"][0].tolist()])
    print("  loss mask      :", batch["loss_mask"][0].int().tolist())
    print(f"4 loss           : {out['loss']:.4f} over {out['num_tokens']} tokens (ln 262 = {math.log(262):.4f})")
    print(f"5 grad norm      : {out['grad_norm']:.4f} (clipped to 1.0)")
    print(f"6 update         : norm {out['update_norm']:.4f}, largest |dw| {out['max_update']:.2e} (lr 1e-3)")

# %% [markdown]
# The checks: the loss sits near $\ln 262$, it averages over exactly the unmasked tokens, no
# weight moved by more than the learning rate, and the reusable `train_step` of the loss page
# computes the same loss and gradient norm on a twin of the model.

# %% tags=["hide-input"]
if __name__ == "__main__":
    assert abs(out["loss"] - math.log(262)) < 0.5                # near-uniform at initialization
    assert out["num_tokens"] == int(batch["loss_mask"].sum())
    assert out["max_update"] <= 1e-3 * 1.01                      # Adam's first step: |dw| <= lr
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.0)
    same = train_step(twin, twin_opt, [batch], pretrain_forward_step)  # the reusable step agrees
    assert abs(same["lm loss"] - out["loss"]) < 1e-5 and abs(same["grad_norm"] - out["grad_norm"]) < 1e-4
    # the running example's sizes in the table above
    gbs, seq, mbs, dp, tp, vocab = 1024, 4096, 2, 64, 2, 128256
    assert gbs * seq == 4_194_304 and gbs // (mbs * dp) == 8
    assert (mbs, seq, vocab // tp) == (2, 4096, 64128) and round(mbs * seq * vocab // tp * 4 / 1e9, 1) == 2.1

# %% [markdown]
# ## What happens next
#
# | box | Megatron at e03878b5f | where this book builds it for real |
# |---|---|---|
# | labels, masks, positions | `megatron/core/datasets/gpt_dataset.py:225`, `:706` | [the batch page](batch.py); [04 · GPTDataset](../04_data/gpt_dataset.py) |
# | SFT packing, `cu_seqlens` | `megatron/training/datasets/sft_dataset.py:91` | [the SFT page](sft.py); [04 · `get_batch`](../04_data/distribute.py) |
# | the loss contract | `pretrain_gpt.py:121`, `megatron/core/pipeline_parallel/schedules.py:251` | [the loss page](loss.py); [01 · the main loop](../01_main_loop/loop.py) |
# | the iteration | `megatron/training/training.py:1029` (`pretrain`), `:3065` (`train`), `:2162` (`train_step`) | [01 · the main loop](../01_main_loop/loop.py) |
# | forward/backward schedules | `schedules.py:634` (no pipelining), `:2089` (1F1B*) | [01 · schedules](../01_main_loop/schedules.py) |
# | grad buffers, DP reduce | `megatron/core/distributed/param_and_grad_buffer.py:940`, `distributed_data_parallel.py:22` | [05 · the contiguous buffer](../05_buffers/param_and_grad_buffer.py) |
# | `finalize_model_grads` | `megatron/core/distributed/finalize_model_grads.py:445` | [05 · `finalize_model_grads`](../05_buffers/finalize_model_grads.py) |
# | clipping, Adam, fp32 master weights | `megatron/core/optimizer/optimizer.py:220` (clip), `:1451` → `:621` (the step that runs: `ChainedOptimizer.step` calls `MixedPrecisionOptimizer.step`); `distrib_optimizer.py:102` | [02 · mixed precision](../02_optimizer/mixed_precision.py), [02 · DistributedOptimizer](../02_optimizer/distributed.py) |
# | checkpoint of weights + optimizer + RNG | `megatron/training/checkpointing.py:495` (save), `:1613` (load) | [03 · checkpoint formats](../03_checkpoint/formats.py) |
# | recompute | `megatron/core/tensor_parallel/random.py:555` (`CheckpointFunction`) | [06 · recompute](../06_recompute_offload/checkpoint.py) |
# | the memory model | `megatron/training/theoretical_memory_usage.py:12`, `:428` | [07 · the ledger](../07_memory/ledger.py) |
# | GRPO | `megatron/rl/rl_utils.py:1855`, `train_rl.py:85` | [the GRPO page](grpo.py) and [the modes page](modes.py) |
#
# \*1F1B, "one forward, one backward": with the model cut into pipeline stages, each stage
# first runs a few micro-batches' forwards (the warm-up), then alternates one forward with one
# backward of an earlier micro-batch, so that at most as many micro-batches as there are stages
# keep their activations alive. [Chapter 01](../01_main_loop/pipeline_orders.py) builds it.
#
# ## Summary
#
# One step is: make a batch, run the model to logits, turn logits and labels into a masked
# per-token loss, reduce it through the loss contract, back-propagate, clip, and step. The
# numbers to watch are the ones printed above: a loss near $\ln V$ at initialization, the token
# count behind it, the gradient norm before clipping, and how far the weights actually moved.
#
# ## Exercises
#
# 1. Set `clip_grad` to 0.01. Does the first AdamW update change? Why not, and what about SGD?
#
#    <details><summary>Answer</summary>
#
#    Barely. Adam's first step is $\eta\, \hat m/(\sqrt{\hat v}+\epsilon)
#    = \eta\, g/(|g|+\epsilon)$, so any rescaling of $g$ cancels except against $\epsilon = 10^{-8}$:
#    the update norm goes from 0.3012 to 0.2958 (only weights whose gradient is near $\epsilon$
#    move less) and the largest step stays $10^{-3}$. SGD moves by $\eta g$, so clipping to 0.01
#    instead of 1.0 makes its update norm 100 times smaller: $10^{-5}$ instead of $10^{-3}$.
#
#    </details>
#
# 2. Turn `eod_mask_loss` off: how many more tokens does the loss average over, and which ones?
#
#    <details><summary>Answer</summary>
#
#    One: 32 tokens instead of 31. The mask drops the position
#    whose input is `<eod>` (row 1, position 7), the one that would learn to predict `a`, the first
#    byte of the next document. The `<eod>` label itself (position 6) is kept either way.
#
#    </details>
