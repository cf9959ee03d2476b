# %% [markdown]
# # 00 · Pretrain, SFT and RL through one train step
#
# The three ways of training a language model differ only in how a micro-batch is made and
# which per-token loss is computed on it. Everything after that (the loss contract, the
# normalization, backward, clipping, the optimizer step) is shared. This page trains one tiny
# model through all three modes on a toy task with a verifiable answer, two-digit sums such as
# `3+4` → `7`, calling the same `train_step` each time.
#
# What you will build: micro-batch makers for each mode, the RL `forward_step`, rollout
# collection with rewards, and a run that pretrains, fine-tunes and then reinforces the model.

# %%
from __future__ import annotations

import copy
from functools import partial

import torch

from tinytron.overview.batch import ByteTokenizer, build_gpt_sample
from tinytron.overview.grpo import (GRPOConfig, completion_loss_mask, group_advantages,
                                    grpo_loss, grpo_loss_func, sample_completions, token_logprobs)
from tinytron.overview.sft import pack_conversations

__all__ = [
    "addition_problems",
    "pretrain_microbatches",
    "sft_microbatches",
    "addition_reward",
    "collect_rollouts",
    "rl_forward_step",
]

# %% [markdown]
# ```mermaid
# flowchart LR
#   P["pretrain: text stream + EOD"] --> BP["GPT samples<br/>shift, EOD masks"]
#   S["SFT: chat JSONL"] --> BS["packed rows<br/>cu_seqlens, prompt masked"]
#   R["RL: prompts"] --> RO["rollouts: G samples,<br/>rewards, advantages"]
#   BP --> F1["pretrain_forward_step<br/>per-token CE"]
#   BS --> F1
#   RO --> F2["rl_forward_step<br/>per-token GRPO loss"]
#   F1 --> C["loss_func → (loss_sum, num_tokens, report)"]
#   F2 --> C
#   C --> T["train_step: normalize, backward,<br/>clip, optimizer.step"]
# ```
#
# ## The task
#
# Prompts `a+b` with $a, b \in 0..4$, answer the digit $a+b$. For pretraining the facts are plain
# documents `3+4=7` separated by EOD; for SFT they are chats (user `3+4`, assistant `7`); for RL
# the model is given the chat prompt and rewarded 1 when it writes exactly the right digit
# followed by `<|end|>`: a reward a program can check, which is what makes GRPO applicable.
#
# Why this task: it is small enough to learn in seconds on a CPU (25 problems, every answer one
# byte token between `0` and `8`), and the same facts can be written in all three forms, so the
# three modes can be compared on one model. A model that has only been pretrained on `3+4=7`
# does not yet know that a chat turn `<|user|> 3+4` wants the digit and then `<|end|>`; SFT
# teaches the format; RL then only has to make the right digit more likely than the wrong ones.

# %% tags=["hide-input"]
def addition_problems(max_operand: int = 4) -> list[tuple[int, int, int]]:
    """All (a, b, a+b) with 0 <= a, b <= max_operand and a one-digit sum."""
    if not 0 <= max_operand <= 4:
        raise ValueError(f"max_operand must be in 0..4 so sums stay one digit, got {max_operand}")
    return [(a, b, a + b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def _stack(samples: list[dict]) -> dict:
    """Stack per-sample dicts into a micro-batch (attention masks [1,s,s] -> [b,1,s,s])."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0] if k != "cu_seqlens"
            and k != "max_seqlen"}


def pretrain_microbatches(problems, tok: ByteTokenizer, seq_length: int, micro_batch_size: int):
    """GPT samples cut from the EOD-separated stream of facts, grouped into micro-batches."""
    stream = [t for a, b, c in problems for t in tok.encode(f"{a}+{b}={c}") + [tok.eod]]
    text = torch.tensor(stream)
    num = (text.numel() - 1) // seq_length
    samples = [build_gpt_sample(text[k * seq_length: (k + 1) * seq_length + 1], tok.eod, tok.pad,
                                reset_position_ids=True, reset_attention_mask=True,
                                eod_mask_loss=True) for k in range(num)]
    return [_stack(samples[i:i + micro_batch_size]) for i in range(0, num, micro_batch_size)]


def sft_microbatches(problems, tok: ByteTokenizer, seq_length: int, micro_batch_size: int = 1):
    """Packed SFT rows of the chats 'a+b' -> 'c', micro_batch_size rows per micro-batch."""
    chats = [[{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(c)}]
             for a, b, c in problems]
    rows = pack_conversations(chats, seq_length, tok)
    return [_stack(rows[i:i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]


# %% [markdown]
# ## RL: rollouts and the forward step
#
# `collect_rollouts` samples `group_size` completions per prompt from the current model, scores
# them, and freezes what the loss needs: $\log\pi_{old}$ recomputed by the training model without
# gradients (`megatron/rl/rl_utils.py:1528`), $\log\pi_{ref}$ from the reference weights (Megatron
# swaps them into the same model, `:1548`; we keep a frozen copy), the sampler's own log-probs as
# $\log\pi_{inf}$ laid over the generated positions of the $\log\pi_{old}$ tensor (`:494`), the loss
# mask over generated tokens and the per-sequence advantages.
# `rl_forward_step` is to RL what `pretrain_forward_step` is to pretraining: run the model, build
# the per-token loss, hand back a `loss_func` with the 3-tuple contract.
#
# What a group teaches: the advantages compare each completion with the others of its prompt.
# A group of four with two right and two wrong answers pushes the right ones up and the wrong
# ones down by the same amount; a group whose four answers are all right (or all wrong) has
# advantage 0 everywhere and changes nothing but the KL term. That is why RL needs a model
# that already gets *some* answers right: the SFT phase.

# %% tags=["hide-input"]
def addition_reward(completion: list[int], answer: int, tok: ByteTokenizer) -> float:
    """1.0 when the completion is exactly the answer digit then <|end|>, else 0.0."""
    return float(completion[:2] == tok.encode(str(answer)) + [tok.end_of_turn])


def _prompt_ids(a: int, b: int, tok: ByteTokenizer) -> list[int]:
    """Chat prompt for 'a+b' up to and including the assistant marker."""
    return [tok.user] + tok.encode(f"{a}+{b}") + [tok.end_of_turn, tok.assistant]


# %% [markdown]
# A rollout is sampled without gradients; everything the loss will compare against is frozen
# here, before the first optimizer pass over it.

# %% tags=["hide-input"]
@torch.no_grad()
def collect_rollouts(model, ref_model, problems, tok: ByteTokenizer, group_size: int,
                     max_new_tokens: int = 2, generator: torch.Generator | None = None) -> dict:
    """One RL micro-batch: sampled sequences, masks, frozen log-probs, rewards and advantages."""
    prompts = torch.tensor([_prompt_ids(a, b, tok) for a, b, _ in problems])
    seqs, sampled_logp, generated = sample_completions(model, prompts, group_size, max_new_tokens,
                                                       tok.end_of_turn, tok.pad, generator)
    p_len = prompts.shape[1]
    answers = [c for _, _, c in problems for _ in range(group_size)]
    rewards = torch.tensor([addition_reward(seqs[i, p_len:].tolist(), answers[i], tok)
                            for i in range(seqs.shape[0])]).view(len(problems), group_size)
    old = token_logprobs(model(seqs), seqs)
    inference = old.clone()
    inference[:, p_len - 1:] = sampled_logp  # where the sampler chose the token
    return {"tokens": seqs, "loss_mask": completion_loss_mask(generated, p_len),
            "old_logprobs": old, "ref_logprobs": token_logprobs(ref_model(seqs), seqs),
            "inference_logprobs": inference, "advantages": group_advantages(rewards),
            "rewards": rewards}


# %% [markdown]
# The forward step reruns the model on the frozen sequences, so only $\log\pi$ carries
# gradients; the config's knobs pass straight into `grpo_loss`.

# %% tags=["hide-input"]
def rl_forward_step(model, batch: dict, config: GRPOConfig | None = None):
    """Per-token GRPO loss of one rollout micro-batch and its loss_func (3-tuple contract)."""
    c = config or GRPOConfig()
    current = token_logprobs(model(batch["tokens"]), batch["tokens"])
    parts = grpo_loss(current, batch["old_logprobs"], batch["ref_logprobs"], batch["advantages"],
                      c.clamp_eps_lower, c.clamp_eps_upper, c.kl_beta, c.entropy_weight,
                      batch["inference_logprobs"] if c.inference_logprobs_is_correction else None,
                      c.is_truncation_coef)
    return parts["loss"], partial(grpo_loss_func, batch["loss_mask"], parts)


# %% [markdown]
# ## Demo: one model, three modes, one `train_step`
#
# 50 pretraining steps, 50 SFT steps, then 8 rollout collections of 2 GRPO passes each, all
# with the same AdamW and the same `train_step`. We measure accuracy by sampling.

# %% tags=["hide-input"]
def _accuracy(model, problems, tok, group_size=8, seed=0) -> float:
    """Mean reward of sampled answers: the fraction of exactly right completions."""
    g = torch.Generator().manual_seed(seed)
    frozen = copy.deepcopy(model)
    return float(collect_rollouts(model, frozen, problems, tok, group_size, generator=g)["rewards"].mean())


@torch.no_grad()
def _completion_logprob(model, batch: dict) -> torch.Tensor:
    """[b] mean log-prob of each sequence's generated tokens under the current model."""
    logp = token_logprobs(model(batch["tokens"]), batch["tokens"])
    mask = batch["loss_mask"]
    return (logp * mask).sum(1) / mask.sum(1).clamp_min(1)


# %% [markdown]
# First the two supervised phases: the same `pretrain_forward_step` (per-token cross entropy)
# on EOD-separated facts, then on packed chats whose prompt tokens are masked out of the loss.

# %% tags=["hide-input"]
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.overview._tiny_model import build_demo_model
    from tinytron.overview.loss import pretrain_forward_step, train_step

    torch.set_num_threads(1)  # tiny matrices: one thread ran 30x faster than two on a busy 2-core box
    tok = ByteTokenizer()
    problems = addition_problems()
    model, name = build_demo_model(vocab_size=tok.vocab_size, seq_length=32, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    history = {"pretrain": [], "sft": [], "rl": []}
    pre = pretrain_microbatches(problems, tok, seq_length=24, micro_batch_size=4)
    for step in range(50):
        history["pretrain"].append(train_step(model, opt, pre, pretrain_forward_step)["lm loss"])
    sft = sft_microbatches(problems, tok, seq_length=32, micro_batch_size=4)
    for step in range(50):
        history["sft"].append(train_step(model, opt, sft, pretrain_forward_step)["lm loss"])
    acc_after_sft = _accuracy(model, problems, tok)

# %% [markdown]
# Then RL: each iteration samples a fresh group of completions per prompt, freezes their
# log-probabilities, and makes `grpo_iterations` passes over them with `rl_forward_step`. The
# SFT model, frozen, is the KL reference.

# %% tags=["hide-input"]
if __name__ == "__main__":
    ref_model = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    # a few big steps on a toy: wider clip and KL than Megatron's defaults (0.01, 0.001)
    rl_config = GRPOConfig(group_size=8, clamp_eps_lower=0.2, clamp_eps_upper=0.28, kl_beta=0.01,
                           inference_logprobs_is_correction=True, is_truncation_coef=2.0)
    rl_step = partial(rl_forward_step, config=rl_config)
    clipped, moved = [], []
    for it in range(8):
        batch = collect_rollouts(model, ref_model, problems, tok, rl_config.group_size, generator=g)
        history["rl"].append(float(batch["rewards"].mean()))
        before = _completion_logprob(model, batch)
        for _ in range(rl_config.grpo_iterations):  # pass 1: ratio 1; pass 2: the clip can act
            stats = train_step(model, opt, [batch], rl_step)
            clipped.append(stats["rl/clipped_above"] + stats["rl/clipped_below"])
        # what GRPO promises: completions with a positive advantage became more likely
        moved.append(float((batch["advantages"] * (_completion_logprob(model, batch) - before)).sum()))
    acc_after_rl = _accuracy(model, problems, tok)

# %% [markdown]
# The three curves, and the claims: both supervised losses fall, RL keeps or improves the
# accuracy, and completions with a positive advantage became more likely.

# %% tags=["hide-input"]
if __name__ == "__main__":
    print(f"model: {name}; pretrain loss {history['pretrain'][0]:.3f} -> {history['pretrain'][-1]:.3f}; "
          f"SFT loss {history['sft'][0]:.3f} -> {history['sft'][-1]:.3f}")
    print(f"accuracy after SFT {acc_after_sft:.3f}, after RL {acc_after_rl:.3f}; "
          f"last RL step: kl {stats['rl/kl']:.4f}, grad norm {stats['grad_norm']:.3f}")
    print("fraction of tokens clipped, first/second pass:",
          [round(c, 3) for c in clipped[0::2]], [round(c, 3) for c in clipped[1::2]])
    fig, axes = plt.subplots(1, 3, figsize=(10, 2.6))
    for ax, (mode, ys) in zip(axes, history.items()):
        ax.plot(ys, marker="." if mode == "rl" else None)
        ax.set_title(f"{mode}: {'mean reward' if mode == 'rl' else 'lm loss'}", fontsize=9)
        ax.set_xlabel("step")
    fig.tight_layout()
    plt.show()
    assert history["pretrain"][-1] < 0.6 * history["pretrain"][0]
    assert history["sft"][-1] < history["sft"][0]
    assert acc_after_rl >= acc_after_sft - 0.05
    print("advantage-weighted change of the completions' mean log-prob per RL iteration:",
          [round(m, 3) for m in moved])
    assert sum(m > 0 for m in moved) >= 6 and sum(moved) > 0  # RL moved the policy the right way
    assert max(clipped[0::2]) == 0 and max(clipped[1::2]) > 0   # ratio is 1 on a fresh rollout

# %% [markdown]
# ## Summary
#
# - Pretraining and SFT use the *same* forward step; only the micro-batches differ (EOD-separated
#   samples vs packed chats with prompt-masked labels).
# - RL builds its micro-batch by sampling from the model and scoring it; its forward step returns a
#   GRPO per-token loss through the same `(loss_sum, num_tokens, report)` contract.
# - One `train_step` (normalize, backward, clip, step) serves all three.
#
# ## How production does it
#
# - `pretrain_gpt.py:183` (`forward_step`), `:332` (datasets, `--sft` switches to `SFTDataset`).
# - `train_rl.py:419`: RL calls the same `pretrain(...)`; rollouts are collected inside `train()`
#   and fed as the data iterator; `megatron/rl/rl_utils.py` holds rollout collection and the loss.
# - [Chapter 01](../01_main_loop/loop.py) builds the real `train_step` and schedules;
#   [chapter 04](../04_data/gpt_dataset.py) the datasets.
#
# ## Exercises
#
# 1. Skip the SFT phase. What is the mean reward of the first rollouts, and why does GRPO then
#    learn almost nothing? (Look at the advantages of a group whose rewards are all 0.)
#
#    <details><summary>Answer</summary>
#
#    0.0. After the 50 pretraining steps alone, the first
#    collection (seed 1, groups of 8) has reward 0 in all 25 groups: the model has never seen the
#    chat format, so no completion is the digit followed by `<|end|>`. `group_advantages` of an
#    all-zero group is 0 for every member, so all 200 advantages are 0 and only the KL term is
#    left, which is 0 (and flat) while the model still equals its reference.
#
#    </details>
#
# 2. Set `kl_beta = 0` and run 50 RL iterations: does the SFT loss on the chats rise?
#
#    <details><summary>Hint</summary>
#
#    Measure it: evaluate `pretrain_forward_step` on the
#    `sft_microbatches` before and after the RL phase, with `GRPOConfig(kl_beta=0, ...)`. Without
#    the k3 term nothing pulls the policy back to the SFT reference; the reward only concerns the
#    two generated tokens, so the measurement tells whether the rest of the chat drifts.
#
#    </details>
