# %% [markdown]
# # 00 · RL with GRPO: rollouts, advantages, a clipped per-token loss
#
# In RL the tokens are not read from a dataset: the model writes them. Megatron's GRPO samples a
# *group* of completions per prompt, scores each with a verifiable reward, turns rewards into
# advantages by normalizing inside the group, and trains with a PPO-style clipped per-token loss
# plus a KL penalty towards a frozen reference model. After that the micro-batch goes through
# the same loss contract and `train_step` as pretraining.
#
# What you will build: per-token log-probabilities, sampling of groups of completions, group
# advantages, `grpo_loss` exactly as Megatron computes it, and its `loss_func`.

# %%
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "GRPOConfig",
    "token_logprobs",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_func",
    "sample_completions",
    "completion_loss_mask",
]

# %% [markdown]
# ## Log-probabilities of the tokens a sequence actually contains
#
# For a sequence $t_0..t_{L-1}$ the model's logits at position $i$ score the next token, so the
# log-probability of $t_{i+1}$ is `log_softmax(logits[:, i])[t_{i+1}]`: a `[b, L-1]` tensor, one
# shorter than the sequence (`megatron/rl/rl_utils.py:744`, `get_logprobs`). Three copies of it
# enter the loss: $\log\pi$ (the model being trained, with gradients), $\log\pi_{old}$ (the
# model that produced the rollouts, frozen at collection time) and $\log\pi_{ref}$ (a frozen
# reference, usually the starting checkpoint).

# %% tags=["hide-input"]
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, i+1] | tokens[:, :i+1]) as [b, L-1] fp32, from logits [b, L, V]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


# %% [markdown]
# ## Group-normalized advantages
#
# With rewards $r_{g,1..G}$ for the $G$ completions of prompt $g$,
# $A_{g,k} = \dfrac{r_{g,k} - \bar r_g}{10^{-4} + \sigma_g}$ with the population standard deviation
# (`calculate_grpo_advantages`, `megatron/rl/rl_utils.py:824`). No value network: the group is its
# own baseline. A group whose completions all score the same gets advantage 0 everywhere and
# teaches nothing. Example: rewards $(1, 0, 0, 0)$ give mean $0.25$, $\sigma = 0.433$,
# advantages $(1.732, -0.577, -0.577, -0.577)$.

# %% tags=["hide-input"]
def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """[num_groups, group_size] rewards -> flat advantages (r - mean) / (eps + population std)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, group_size>=2], got {tuple(rewards.shape)}")
    rewards = rewards.double()  # 1e-4 next to a std of ~0.4: keep the small term exact
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return ((rewards - mean) / (eps + std)).reshape(-1).float()


# %% [markdown]
# ## The per-token GRPO loss
#
# `calculate_grpo_loss` (`megatron/rl/rl_utils.py:1855`), per token, with the advantage $A$ of the
# token's sequence broadcast to all its tokens:
#
# $$r = e^{\log\pi - \log\pi_{old}}, \qquad
#   L = -w\,\min\!\big(rA,\ \mathrm{clip}(r, 1-\epsilon_{lo}, 1+\epsilon_{hi})\,A\big) +
#       \beta\,\mathrm{KL} - \lambda_{ent} H$$
#
# $$\mathrm{KL} = e^{\log\pi_{ref} - \log\pi} - (\log\pi_{ref} - \log\pi) - 1
#   \quad(\text{the "k3" estimator, always} \ge 0), \qquad H = -e^{\log\pi}\log\pi$$
#
# The importance weight $w = e^{\log\pi_{old} - \log\pi_{inf}}$ corrects for the inference engine
# (which sampled the tokens, with its own numerics) disagreeing with the training model's
# $\pi_{old}$; it is capped at `is_truncation_coef` when that is set, and is 1 when no inference
# log-probs are given. The min makes the objective pessimistic: for $A > 0$ the ratio gains
# nothing above $1+\epsilon_{hi}$; for $A < 0$ nothing below $1-\epsilon_{lo}$. Megatron also
# returns which tokens were clipped from above ($r > 1+\epsilon_{hi}$) and below
# ($r < 1-\epsilon_{lo}$), for logging.
#
# Megatron's defaults are tight: $\epsilon_{lo} = \epsilon_{hi} = 0.01$, $\beta = 0.001$, no entropy
# term, groups of 2 completions for 32 prompts per step, and each collection of rollouts is used
# for `grpo_iterations = 2` passes of optimizer steps (`megatron/training/arguments.py:2380-2440`,
# `megatron/rl/rl_utils.py:1701`). Only from the second pass on does $\pi$ differ from
# $\pi_{old}$, so only then can the clip bite. `GRPOConfig` carries these settings.

# %% tags=["hide-input"]
def grpo_loss(current_logprobs, old_logprobs, ref_logprobs, advantages, clamp_eps_lower: float,
              clamp_eps_upper: float, kl_beta: float, entropy_weight: float = 0.0,
              inference_logprobs=None, is_truncation_coef: float | None = None) -> dict:
    """Per-token GRPO loss [b, L-1] and its parts; advantages are per sequence [b]."""
    if advantages.dim() != 1 or advantages.shape[0] != current_logprobs.shape[0]:
        raise ValueError(f"advantages must be [b={current_logprobs.shape[0]}], got "
                         f"{tuple(advantages.shape)}")
    adv = advantages.view(-1, 1)
    ratios = torch.exp(current_logprobs - old_logprobs)
    clamped = ratios.clamp(1 - clamp_eps_lower, 1 + clamp_eps_upper)
    ref_diff = ref_logprobs - current_logprobs
    kl = torch.exp(ref_diff) - ref_diff - 1
    entropy = -torch.exp(current_logprobs) * current_logprobs
    weight = torch.ones((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    if inference_logprobs is not None:
        weight = torch.exp(old_logprobs - inference_logprobs)
        if is_truncation_coef is not None:
            weight = weight.clamp(max=is_truncation_coef)
    loss = -weight * torch.minimum(ratios * adv, clamped * adv) + kl_beta * kl - entropy_weight * entropy
    return {"loss": loss, "kl": kl, "ratios": ratios, "entropy": entropy,
            "clipped_above": ratios > 1 + clamp_eps_upper,
            "clipped_below": ratios < 1 - clamp_eps_lower}


# %% [markdown]
# The knobs with Megatron's names and defaults, checked when the config is built (a clip range
# that excludes 1 would clip every token of the first pass):

# %% tags=["hide-input"]
@dataclass
class GRPOConfig:
    """GRPO knobs with Megatron's defaults (megatron/training/arguments.py:2380-2440)."""

    group_size: int = 2
    """Completions sampled per prompt (--grpo-group-size)."""
    prompts_per_step: int = 32
    """Prompts per rollout collection (--grpo-prompts-per-step)."""
    grpo_iterations: int = 2
    """Optimizer passes over each rollout collection before sampling again (--grpo-iterations)."""
    clamp_eps_lower: float = 0.01
    """Ratio clip below 1 (--grpo-clamp-eps-lower)."""
    clamp_eps_upper: float = 0.01
    """Ratio clip above 1 (--grpo-clamp-eps-upper); larger than lower = "clip-higher"."""
    kl_beta: float = 0.001
    """Weight of the k3 KL term towards the reference model (--grpo-kl-beta)."""
    entropy_weight: float = 0.0
    """Weight of the entropy bonus (--grpo-entropy-term-weight)."""
    inference_logprobs_is_correction: bool = False
    """Use the sampler's log-probs as an importance weight (--rl-inference-logprobs-is-correction)."""
    is_truncation_coef: float | None = None
    """Cap on the importance weight (--rl-importance-sampling-truncation-coef); None = no cap."""

    def __post_init__(self):
        if self.grpo_iterations < 1:
            raise ValueError(f"grpo_iterations must be >= 1, got {self.grpo_iterations}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages need a group), got {self.group_size}")
        if not (0 <= self.clamp_eps_lower < 1 and self.clamp_eps_upper >= 0):
            raise ValueError(f"clip range (1-{self.clamp_eps_lower}, 1+{self.clamp_eps_upper}) is invalid")


# %% [markdown]
# The per-token loss then enters the schedule through the same `loss_func` contract as
# pretraining ([the loss page](loss.py)): a masked sum, the number of tokens it covers, and a
# report of `[sum, count]` pairs that the loop averages over micro-batches and data-parallel
# ranks. The RL report adds the KL, the ratios, the entropy and the two clip counts.

# %% tags=["hide-input"]
def grpo_loss_func(loss_mask: torch.Tensor, parts: dict, output_tensor: torch.Tensor):
    """RL loss_func with the 3-tuple contract: (loss_sum, num_tokens, report of [sum, count] pairs)."""
    mask = loss_mask.reshape(-1).float()
    total = mask.sum().clamp(min=1)  # an all-masked row still reports a count of 1, as train_rl.py:85
    loss_sum = torch.sum(output_tensor.reshape(-1).float() * mask)
    report = {"lm loss": torch.stack([loss_sum.detach(), total])}
    for key in ("kl", "ratios", "entropy", "clipped_above", "clipped_below"):
        masked = torch.sum(parts[key].detach().reshape(-1).float() * mask)
        report[f"rl/{key}"] = torch.stack([masked, total])
    return loss_sum, total.to(torch.int), report


# %% [markdown]
# ## Rollouts: groups of sampled completions
#
# Each prompt is repeated $G$ times and the model samples up to `max_new_tokens` tokens at
# temperature 1, recording the log-probability of every sampled token (this plays the inference
# engine's $\log\pi_{inf}$). After the first `<|end|>` the sequence is finished: later positions
# are filled with the pad id and excluded from the loss. The loss mask lives in log-prob space
# (`[b, L-1]`): entry $i$ is 1 when token $i+1$ is a generated token up to and including `<|end|>`.
# Real systems run this with a dedicated inference engine and KV caches; a plain loop over
# positions is enough for 3-token answers.

# %% tags=["hide-input"]
@torch.no_grad()
def sample_completions(model, prompts: torch.Tensor, group_size: int, max_new_tokens: int,
                       end_id: int, pad_id: int, generator: torch.Generator | None = None):
    """(sequences [P*G, Lp+T], sampled-token logprobs [P*G, T], generated mask [P*G, T])."""
    seqs = prompts.repeat_interleave(group_size, dim=0)
    logps, live = [], []
    done = torch.zeros(seqs.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = model(seqs)[:, -1].float()
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        logps.append(torch.log(probs.gather(-1, nxt[:, None]).squeeze(-1)))
        live.append(~done)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        done = done | (nxt == end_id)
        seqs = torch.cat([seqs, nxt[:, None]], dim=1)
    return seqs, torch.stack(logps, dim=1), torch.stack(live, dim=1)


def completion_loss_mask(generated: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[b, L-1] float mask in log-prob space from the [b, T] generated-token mask."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    prompt_part = torch.zeros(generated.shape[0], prompt_len - 1)
    return torch.cat([prompt_part, generated.float()], dim=1)


# %% [markdown]
# ## Demo: the loss by hand, clipping on both sides
#
# Two sequences of three tokens, $\epsilon_{lo} = 0.2$, $\epsilon_{hi} = 0.28$ (an asymmetric
# "clip-higher" setting), $\beta = 0.1$. The ratios are chosen to land inside, above and below the
# clip range, and the advantages have both signs.

# %% tags=["hide-input"]
if __name__ == "__main__":
    import math

    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    cur = old + torch.log(torch.tensor([[1.1, 1.5, 0.6], [1.1, 1.5, 0.6]]))  # r = 1.1, 1.5, 0.6
    ref = torch.log(torch.tensor([[0.4, 0.6, 0.5], [0.5, 0.5, 0.5]]))
    adv = torch.tensor([2.0, -1.0])
    out = grpo_loss(cur, old, ref, adv, clamp_eps_lower=0.2, clamp_eps_upper=0.28, kl_beta=0.1)

    def by_hand(r, a, lp, lr):
        """One token's loss written out with Python floats."""
        clipped = min(max(r, 0.8), 1.28)
        kl = math.exp(lr - lp) - (lr - lp) - 1
        return -min(r * a, clipped * a) + 0.1 * kl

    for b in range(2):
        for i, r in enumerate([1.1, 1.5, 0.6]):
            want = by_hand(r, float(adv[b]), float(cur[b, i]), float(ref[b, i]))
            got = float(out["loss"][b, i])
            print(f"A={float(adv[b]):+.0f} r={r:.1f}: loss {got:+.5f} (by hand {want:+.5f}) "
                  f"clipped above={bool(out['clipped_above'][b, i])} below={bool(out['clipped_below'][b, i])}")
            assert abs(got - want) < 1e-6
    # A>0, r=1.5: the gain stops at 1.28; A<0, r=0.6: the gain stops at 0.8
    assert abs(float(out["loss"][0, 1]) - (-1.28 * 2 + 0.1 * float(out["kl"][0, 1]))) < 1e-6
    assert abs(float(out["loss"][1, 2]) - (0.8 * 1 + 0.1 * float(out["kl"][1, 2]))) < 1e-6
    print("advantages of rewards (1,0,0,0), (1,1,0,0):",
          group_advantages(torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 0, 0]])).tolist())

# %% [markdown]
# ## The clipped objective, drawn
#
# The same `grpo_loss`, with $\beta = 0$ and one token per sequence, evaluated over a sweep of
# ratios for $A = +1$ and $A = -1$. The objective is $-L$ (what the optimizer increases). For a
# good token ($A > 0$) it rises with the ratio until $1 + \epsilon_{hi}$ and then stays flat: the
# gradient is zero, so one batch cannot push that token's probability far from the policy that
# sampled it. For a bad token ($A < 0$) it is flat below $1 - \epsilon_{lo}$. On the other side
# of 1 the unclipped term wins the min and the slope stays: a token that moved the wrong way is
# always pulled back.

# %% tags=["hide-input"]
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    r = torch.linspace(0.5, 1.6, 111)
    old_lp = torch.zeros(len(r), 1)
    fig, ax = plt.subplots(figsize=(7, 3))
    for a, color in ((1.0, "tab:blue"), (-1.0, "tab:red")):
        parts = grpo_loss(torch.log(r)[:, None], old_lp, torch.log(r)[:, None], torch.full((len(r),), a),
                          clamp_eps_lower=0.2, clamp_eps_upper=0.28, kl_beta=0.0)
        objective = -parts["loss"][:, 0]
        ax.plot(r, objective, color=color, label=f"A = {a:+.0f}")
        ax.plot(r, r * a, color=color, ls=":", lw=1)  # the unclipped ratio * A, for contrast
        flat = objective[parts["clipped_above"][:, 0] if a > 0 else parts["clipped_below"][:, 0]]
        assert torch.allclose(flat, flat[0].expand_as(flat)), "clipped side must be flat"
    ax.axvspan(0.8, 1.28, color="0.92", zorder=0, label="clip range (0.8, 1.28)")
    ax.set_xlabel("ratio r = π / π_old")
    ax.set_ylabel("objective  −L (β = 0)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("min(r·A, clip(r)·A): flat where a step would move too far", fontsize=10)
    plt.tight_layout()
    plt.show()

# %% [markdown]
# ## Summary
#
# - GRPO's tokens come from the model; rewards are verified per completion and normalized within
#   the group of completions of one prompt.
# - The per-token loss is a clipped policy-gradient term (asymmetric clip allowed), a k3 KL term
#   towards a frozen reference, an optional entropy bonus, and an optional (truncated) importance
#   weight against the inference engine's log-probs.
# - Its `loss_func` returns the same `(loss_sum, num_tokens, report)` as pretraining, so the same
#   schedule, optimizer and `train_step` apply.
#
# ## How production does it
#
# - `megatron/rl/rl_utils.py:824` (advantages), `:744` (`get_logprobs`), `:1855`
#   (`calculate_grpo_loss`); `train_rl.py:85` (`loss_func`), `:419` (`pretrain(...)` with the RL
#   step); sequence packing of rollouts in `megatron/rl/sequence_packing_utils.py`.
#
# ## Exercises
#
# 1. Show that with $\log\pi = \log\pi_{old}$ (the first step after a rollout) the gradient of the
#    clipped term equals the plain policy gradient $-A\,\nabla\log\pi$.
#
#    <details><summary>Answer</summary>
#
#    At $\log\pi = \log\pi_{old}$ the ratio is $r = 1$, strictly
#    inside $(1-\epsilon_{lo}, 1+\epsilon_{hi})$, so the clip is the identity there and both
#    arguments of the min are $rA$. The term is $-w\,rA$, and $\nabla r = r\,\nabla\log\pi =
#    \nabla\log\pi$ at $r = 1$, so its gradient is $-wA\,\nabla\log\pi$: the plain policy
#    gradient, with $w = 1$ when no inference log-probs are given.
#
#    </details>
#
# 2. Why is the k3 estimator non-negative for every sample, while $\log\pi - \log\pi_{ref}$ is not?
#
#    <details><summary>Answer</summary>
#
#    Write $x = \log\pi_{ref} - \log\pi$. Then k3 is
#    $e^x - x - 1$, and $e^x \ge 1 + x$ for every real $x$ (the exponential lies above its tangent
#    at 0), with equality only at $x = 0$. The plain difference $-x$ takes either sign per sampled
#    token; only its mean under $\pi$, the KL divergence, is non-negative.
#
#    </details>
