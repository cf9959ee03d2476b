# %% [markdown]
# # 05 · Buffers: finalize_model_grads, the last stop before the optimizer
#
# After the last micro-batch's backward, three kinds of gradients are still incomplete:
# the DP collectives may still be in flight, parameters replicated across tensor-parallel
# ranks under sequence parallelism saw only part of the sequence, and a tied embedding has two
# copies on two pipeline stages that each saw half of its uses. We build Megatron's
# `finalize_model_grads` that completes all three, and the optional per-token normalization.

# %%
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tinytron.buffers._comm import axis_info

__all__ = ["finalize_model_grads", "main_grad_of"]

# %% [markdown]
# ## Four steps, in Megatron's order
#
# `megatron/core/distributed/finalize_model_grads.py:445` runs, for the model chunks of one
# rank (several with the interleaved schedule):
#
# 1. **`finish_grad_sync()`** on every chunk: wait for the bucket collectives the backward
#    hooks launched (or run them now without overlap). Every grad is now the DP×CP mean
#    (with the distributed optimizer: in this rank's shard).
# 2. **Sequence-parallel replicated params** (`:367`). With sequence parallelism the RMSNorm
#    weights are replicated on every TP rank, but each TP rank ran the norm on only its
#    `s/tp` slice of the sequence. The full gradient is the **sum** over TP ranks. The grads of
#    all such params are flattened into one tensor, all-reduced over the TP group and copied
#    back (one collective instead of one per norm). Params flagged
#    `average_gradients_across_tp_domain` are averaged instead. The same SUM applies, with or
#    without SP, to QK-norm weights (names containing `q_layernorm` / `k_layernorm`,
#    `finalize_model_grads.py:403`): each TP rank normalizes only its own heads, so each holds
#    a partial gradient. tinytron's model has no QK-norm, but the rule is here, so adding one
#    cannot silently let the TP ranks' copies drift apart.
# 3. **Tied embedding** (`:164`). With `tie_embeddings` and pipeline parallelism the first
#    stage owns the input embedding and the last stage a copy used as the output layer, both
#    flagged `shared_embedding`. Each copy has the gradient of its own use only; the true
#    gradient is their **sum**, so both stages all-reduce it over the `embd` group (first +
#    last stage) and then apply the same update, keeping the copies identical.
# 4. **Per-token normalization** (`:545-562`, only when `num_tokens` is given). With
#    `calculate_per_token_loss` the loss is a *sum* over tokens and DDP did not average; the
#    last stage counts the non-masked tokens, broadcasts the count over the pipeline group, the
#    count is summed over DP×CP, and every gradient is multiplied by `1/max(num_tokens, 1)`.
#    The result is the gradient of the mean loss over all tokens of the global batch,
#    $\nabla \frac{1}{n}\sum_{r}\sum_{t \in r} \ell_t$ with $n = \sum_r n_r$, correct even when
#    micro-batches and DP ranks hold different numbers $n_r$ of real tokens.
#
# Why these reductions are safe on a sharded buffer: every TP rank (and the first and last
# stage, thanks to the tied embedding's own bucket) has the *same* buffer layout, so with the
# distributed optimizer the slices a rank owns line up across the group and stay consistent.
#
# ### Worked example in small numbers
#
# A norm weight `g` (one element) under SP with `tp = 2`: TP rank 0 processes tokens 0-1 and
# gets `∂L/∂g = 0.3`, rank 1 tokens 2-3 and gets `0.5`; the single-process gradient is `0.8`,
# which both ranks hold after the SUM all-reduce. A tied embedding row gets `0.1` from the
# input use on stage 0 and `-0.4` from the output use on stage 1: after the `embd` all-reduce
# both stages hold `-0.3`. With per-token loss, two DP ranks with 6 and 10 real tokens and
# summed losses: grads are multiplied by `1/16`.
#
# ```mermaid
# flowchart TD
#   A["finish_grad_sync (DP x CP mean)"] --> B["TP all-reduce SUM of sequence_parallel grads"]
#   B --> C["embd all-reduce SUM of shared_embedding grad (first + last stage)"]
#   C --> D{"num_tokens given?"}
#   D -- yes --> E["broadcast from last stage, all-reduce over DP x CP, grads *= 1/max(n,1)"]
#   D -- no --> F["optimizer.step()"]
#   E --> F
# ```

# %%
def main_grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The grad the optimizer will read: ``main_grad`` under DDP, else ``.grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def _is_qk_norm(name: str) -> bool:
    """A QK-norm weight by Megatron's naming rule (finalize_model_grads.py:403)."""
    return "q_layernorm" in name or "k_layernorm" in name


def _allreduce_tp_replicated_grads(model_chunks, grid) -> int:
    """SUM over TP the grads of sequence_parallel params (AVG for the averaged ones)."""
    group, tp, _ = axis_info(grid, "tp")
    if tp == 1:
        return 0
    buckets = {dist.ReduceOp.SUM: [], dist.ReduceOp.AVG: []}
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            grad = main_grad_of(p) if p.requires_grad else None
            if grad is None:
                continue
            if getattr(p, "average_gradients_across_tp_domain", False):
                buckets[dist.ReduceOp.AVG].append(grad)
            elif getattr(p, "sequence_parallel", False) or _is_qk_norm(name):
                buckets[dist.ReduceOp.SUM].append(grad)
    for op, grads in buckets.items():
        if grads:  # one collective for all of them
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=op, group=group)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
    return sum(len(g) for g in buckets.values())


# %% [markdown]
# The tied embedding: the first stage's input table and the last stage's output copy are one
# parameter, so each holds half of its gradient until one all-reduce over the two of them.

# %%
def _shared_embedding_weight(chunk):
    """The parameter of ``chunk`` flagged ``shared_embedding`` (None if it has none)."""
    for p in chunk.parameters():
        if getattr(p, "shared_embedding", False) and p.requires_grad:
            return p
    return None


def _allreduce_word_embedding_grads(model_chunks, grid) -> bool:
    """SUM the tied embedding grad over the embd group (first and last pipeline stage)."""
    group, size, _ = axis_info(grid, "embd")
    if size <= 1 or group is None:
        return False
    # The embedding lives in the first chunk on the first stage, the output copy in the last.
    chunk = model_chunks[0] if grid.is_first_stage() else model_chunks[-1]
    weight = _shared_embedding_weight(chunk)
    grad = main_grad_of(weight) if weight is not None else None
    if grad is None:
        return False
    dist.all_reduce(grad, group=group)
    return True


# %% [markdown]
# With the per-token loss, only the last stage knows the token count: it is broadcast down the
# pipeline, summed over the data-parallel ranks, and every grad is divided by it once.

# %%
def _normalize_by_tokens(model_chunks, grid, num_tokens: torch.Tensor) -> torch.Tensor:
    """Make ``num_tokens`` the global count, then scale every grad by 1/max(count, 1)."""
    pp_group, pp, _ = axis_info(grid, "pp")
    if pp > 1:  # only the last stage computed the loss and knows the count
        dist.broadcast(num_tokens, src=grid.ranks("pp")[-1], group=pp_group)
    dp_group, dp, _ = axis_info(grid, "dp_cp")
    if dp > 1:
        dist.all_reduce(num_tokens, group=dp_group)
    scale = 1.0 / torch.clamp(num_tokens.float(), min=1)
    for chunk in model_chunks:
        if hasattr(chunk, "scale_gradients"):
            chunk.scale_gradients(scale)
        else:
            for p in chunk.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
    return num_tokens


# %%
def finalize_model_grads(model_chunks, grid, num_tokens: torch.Tensor | None = None) -> dict:
    """Finish DP sync, TP-reduce SP grads, PP-reduce tied embeddings, normalize by tokens."""
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    if not model_chunks:
        raise ValueError("finalize_model_grads needs at least one model chunk, got []")
    if num_tokens is not None and (not torch.is_tensor(num_tokens) or num_tokens.numel() != 1):
        raise ValueError(f"num_tokens must be a 1-element tensor, got {num_tokens!r}")
    for chunk in model_chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
    num_tp = _allreduce_tp_replicated_grads(model_chunks, grid)
    tied = _allreduce_word_embedding_grads(model_chunks, grid)
    if num_tokens is not None:
        num_tokens = _normalize_by_tokens(model_chunks, grid, num_tokens)
    return {"tp_reduced_params": num_tp, "embedding_reduced": tied, "num_tokens": num_tokens}


# %% [markdown]
# ## Demo: a tied table over two stages, an SP norm, and a token count
#
# A 4-rank world, `tp = 2 × pp = 2`. A 12×6 table is used as the input embedding on stage 0
# and (its tied copy) as the output layer on stage 1; stage 1 also has a norm gain under
# sequence parallelism, each TP rank applying it to its half of the 8-token sequence; 6 of the
# 8 tokens are real. Each rank's loss is a *sum* over its tokens. We compare the grads before
# and after `finalize_model_grads` with one process computing the mean loss over the 6 tokens.

# %%
if __name__ == "__main__":
    from tinytron.buffers._workers import finalize_demo, finalize_reference
    from tinytron.launch import run_on_ranks

    ref = finalize_reference()
    ranks = run_on_ranks(finalize_demo, 4, timeout=120)
    for r in ranks:
        err = {n: (g - ref[n if n != "word" else "table"]).abs().max().item()
               for n, g in r["after"].items()}
        print(f"stage {r['stage']} tp {r['tp_rank']}: tokens={r['num_tokens']:.0f}, "
              f"max |grad - single-process| after finalize: {err}")
    last = [r for r in ranks if r["stage"] == 1]
    print("gain grad before (tp0, tp1):", [round(r["before"]["gain"][0].item(), 4) for r in last],
          "after:", round(last[0]["after"]["gain"][0].item() * 6, 4), "(x6 tokens)")
    for r in ranks:
        assert r["num_tokens"] == 6
        assert torch.allclose(r["after"]["word"], ref["table"], atol=1e-6)
        if r["stage"] == 1:
            assert torch.allclose(r["after"]["gain"], ref["gain"], atol=1e-6)
            assert not torch.allclose(r["before"]["gain"] / 6, ref["gain"], atol=1e-6)
    assert torch.equal(ranks[0]["after"]["word"], ranks[-1]["after"]["word"])

# %% [markdown]
# ## Summary
#
# - `finalize_model_grads` = finish the DP collectives, SUM the grads of sequence-parallel
#   replicated params over TP, SUM the tied embedding grad over the first and last stage,
#   and (per-token loss) divide everything by the global number of real tokens.
# - All three reductions act on `main_grad`, i.e. on the flat buffer, in place.
# - The demo shows each rank's partial grads becoming exactly the single-process grads.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/distributed/finalize_model_grads.py` (`finalize_model_grads`
#   :445, `_allreduce_non_tensor_model_parallel_grads` :367, `_allreduce_word_embedding_grads`
#   :164, `_allreduce_embedding_grad` :204, token normalization :545-562), called by the
#   schedules at the end of `forward_backward_func`
#   (`megatron/core/pipeline_parallel/schedules.py`).
# - torchtitan with FSDP2 + TP uses DTensor: a norm weight under SP is a `Replicate()` DTensor
#   whose gradient is reduced by DTensor's redistribution, so there is no separate step.
#
# ## Exercises
#
# 1. Remove `sequence_parallel = True` from the gain in the demo. Which assertion fails and
#    by what factor is the gradient off?
#    <details><summary>Answer</summary>
#
#    The stage-1 check
#    `torch.allclose(r["after"]["gain"], ref["gain"])` fails: the gain is no longer TP-summed,
#    so each TP rank keeps the gradient of its own half of the sequence. There is no single
#    factor. For the gain's first element (the demo prints it) rank 0 holds $-2.1541$ and rank
#    1 holds $0.5674$ (before the division by 6), against the true sum $-1.5868$: 1.36× on rank
#    0, and $-0.36$× on rank 1, where even the sign is wrong.
#
#    </details>
#
# 2. Why does Megatron broadcast `num_tokens` from the last stage instead of letting every
#    stage count tokens itself?
#    <details><summary>Hint</summary>
#
#    Which stages receive `labels` and `loss_mask` from
#    `get_batch`? See the stage table on [the `get_batch` page](../04_data/distribute.py): only
#    the last stage computes the loss, so only it knows which tokens count.
#
#    </details>
#
# 3. With the distributed optimizer only a shard of each bucket is valid after step 1. Why is
#    the TP all-reduce of the full `main_grad` still correct for the shard this rank owns?
#    <details><summary>Hint</summary>
#
#    An all-reduce is element by element. Every TP rank has
#    the same buffer layout and the same DP rank, so it owns the same shard; each element of
#    that shard is summed only with valid elements. The stale elements outside the shard
#    become stale sums, which nobody reads.
#
#    </details>
