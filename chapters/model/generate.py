# %% [markdown]
# # B.6 · Model: generating text with a KV cache
#
# A trained model predicts the next token from every token before it. Generating text repeats
# that prediction: append the token drawn, predict again. Done naively, every step runs the
# whole sequence through the model again, although the keys and values of the earlier
# positions have not changed. The KV cache keeps them, so each new token costs one position per
# layer instead of the whole prefix. This page shows why that is exact (not an approximation),
# what it costs in memory, and checks it against the model's own forward.
#
# You will use: `KVCache`, `forward_with_cache`, `sample_next` and `generate` from
# `tinytron.model._generate` (the module behind the `tinytron-generate` command).

# %%
from __future__ import annotations

import torch

from tinytron.model._generate import KVCache, forward_with_cache, generate, sample_next
from tinytron.model.config import llama_7b_config, tiny_config
from tinytron.model.gpt import GPTModel

__all__ = ["kv_cache_bytes", "positions_computed"]

# %% [markdown]
# ## Why the cache is exact
#
# In a causal decoder, position $i$'s output in every layer depends only on positions
# $0 \dots i$: its query attends to the keys and values of positions $\le i$ (the causal mask),
# and everything else in the layer (the norms, the projections, RoPE, the MLP) works on one
# position at a time. So appending token $n$ changes nothing at positions $0 \dots n-1$: their
# keys and values in every layer are the ones the previous step computed. Only position $n$
# is new, and it needs its own query, key and value plus the cached keys and values of the
# positions before it.
#
# A step with the cache therefore runs one position through each layer: norm, the fused QKV
# projection, RoPE at position $n$ (the rotation depends on the absolute position, so the
# cache stores keys *after* RoPE), write $k_n, v_n$ into the cache's slot $n$, attend $q_n$ to
# slots $0 \dots n$, the output projection and the MLP. The prompt itself is one pass over all
# its positions at once ("prefill"), which fills slots $0 \dots p-1$.
#
# With grouped-query attention the cache holds the $g$ key/value groups, not the $a$ query
# heads: each group's keys serve $a/g$ query heads (`enable_gqa` in PyTorch's attention). For
# the running example that is 8 groups instead of 32 heads: a 4× smaller cache.

# %% [markdown]
# ## What it saves, and what it costs
#
# Without the cache, step $t$ (the sequence has $p + t$ tokens) recomputes all $p + t$
# positions; generating $n$ tokens after a prompt of $p$ computes
# $\sum_{t=0}^{n-1} (p + t) = n p + n(n-1)/2$ positions per layer. With the cache: $p$ for the
# prefill and 1 per later step, $p + n - 1$. Worked in small numbers, $p = 8$, $n = 24$:
# $192 + 276 = 468$ positions against $31$, 15× fewer, and the gap grows with $n$.
#
# The price is memory: per sequence, 2 tensors (keys and values) × $L$ layers × $g$ groups ×
# $d$ head dimensions × the sequence length, in the model's dtype. For the running example
# (Llama-3-8B's shape: $L = 32$, $g = 8$, $d = 128$) in bf16 that is
# $2 \cdot 32 \cdot 8 \cdot 128 \cdot 2 = 131{,}072$ bytes per token: 512 MiB for one sequence
# of 4096 tokens, beside 14 GiB of weights.

# %%
def positions_computed(prompt: int, new: int, cached: bool) -> int:
    """Positions run through each layer to generate `new` tokens after `prompt` tokens."""
    if cached:
        return prompt + max(new - 1, 0)
    return new * prompt + new * (new - 1) // 2


def kv_cache_bytes(config, tokens: int, batch: int = 1, bytes_per_element: int = 2) -> int:
    """Bytes of the keys and values a cache holds for `tokens` positions of `batch` sequences."""
    return (2 * config.num_layers * config.num_query_groups * config.head_dim * tokens * batch
            * bytes_per_element)


if __name__ == "__main__":
    assert positions_computed(8, 24, cached=False) == 468
    assert positions_computed(8, 24, cached=True) == 31
    big = llama_7b_config()
    per_token = kv_cache_bytes(big, 1)
    print(f"running example: {per_token:,} bytes per token, "
          f"{kv_cache_bytes(big, 4096) / 2**20:.0f} MiB for one sequence of 4096 tokens")
    assert per_token == 131_072 and kv_cache_bytes(big, 4096) == 512 * 2**20

# %% [markdown]
# ## The picture: work per step
#
# Each step of generation, drawn as the positions it runs through a layer: without the cache
# the bar grows with the sequence, with the cache it is the prompt once and then one position.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    p, n = 8, 24
    steps = range(n)
    naive = [p + t for t in steps]
    cached = [p if t == 0 else 1 for t in steps]
    fig, ax = plt.subplots(figsize=(6.4, 2.6))
    ax.bar([t - 0.2 for t in steps], naive, width=0.4, label="recompute the sequence",
           color="#c44e52")
    ax.bar([t + 0.2 for t in steps], cached, width=0.4, label="KV cache", color="#4c72b0")
    ax.set_xlabel("generation step (prompt of 8 tokens)")
    ax.set_ylabel("positions per layer")
    ax.set_title(f"24 new tokens: {sum(naive)} positions vs {sum(cached)}")
    ax.legend()
    fig.tight_layout()
    plt.show()
    assert sum(naive) == positions_computed(p, n, False)
    assert sum(cached) == positions_computed(p, n, True)

# %% [markdown]
# ## Sampling the next token
#
# `sample_next` turns the last position's logits into a token. At temperature 0 it takes the
# most likely one (greedy). Otherwise it divides the logits by the temperature (below 1: a
# sharper distribution, above 1: a flatter one), keeps only the `top_k` largest (if set) and
# the smallest set of tokens whose probabilities reach `top_p` (nucleus sampling, if below 1),
# and draws from what is left with a seeded generator, so the same seed gives the same text.
# Worked example: probabilities 0.5, 0.3, 0.15, 0.05 with `top_p = 0.7` keep the first two
# (0.5 does not reach 0.7, 0.5 + 0.3 does).

# %%
if __name__ == "__main__":
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert int(sample_next(logits)) == 0                                       # greedy
    g = torch.Generator().manual_seed(0)
    nucleus = {int(sample_next(logits, 1.0, top_p=0.7, generator=g)) for _ in range(200)}
    top3 = {int(sample_next(logits, 1.0, top_k=3, generator=g)) for _ in range(200)}
    print("top_p 0.7 draws from", sorted(nucleus), "· top_k 3 from", sorted(top3))
    assert nucleus == {0, 1} and top3 == {0, 1, 2}, (nucleus, top3)

# %% [markdown]
# ## Demo: the cache against the model's own forward
#
# A small model with random weights (the check needs no training: it is about arithmetic, not
# text). Step by step, the logits `forward_with_cache` returns for the newest position equal
# those of the model's full forward over the whole sequence, and greedy generation with the
# cache gives the same tokens as recomputing everything (`use_cache=False`). A cache too short
# for the request is refused. The trained-model check, greedy decoding equal to `transformers`'
# on the exported model, is in the tests.

# %%
if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = tiny_config(seq_length=48)
    model = GPTModel(cfg).eval()
    prompt = torch.randint(0, 262, (1, 8))
    cache = KVCache(cfg.num_layers, 1, cfg.num_query_groups, 40, cfg.head_dim,
                    torch.float32, "cpu")
    ids, step_input, worst = prompt, prompt, 0.0
    with torch.no_grad():
        for _ in range(32):
            with_cache = forward_with_cache(model, step_input, cache)
            full = model(ids)[:, -1].float()
            worst = max(worst, float((with_cache - full).abs().max()))
            step_input = with_cache.argmax(-1, keepdim=True)
            ids = torch.cat([ids, step_input], dim=1)
    print(f"32 steps: cache length {cache.length}, largest logit difference {worst:.2e}")
    assert cache.length == 8 + 31 and worst < 1e-4   # the prefill, then 31 single steps
    fast = generate(model, prompt[0].tolist(), 24)
    slow = generate(model, prompt[0].tolist(), 24, use_cache=False)
    assert fast == slow and len(fast) == 24, (fast, slow)
    try:
        forward_with_cache(model, prompt, cache)    # 39 + 8 positions in a cache of 40
        raise AssertionError("a full cache must refuse more positions")
    except ValueError as err:
        print("refused:", err)

# %% [markdown]
# ## In Megatron, and in tinytron
#
# Megatron's inference keeps a cache of the same kind per layer: the attention's
# `_adjust_key_value_for_inference` (`megatron/core/transformer/attention.py:523`) allocates
# each layer's key and value memory in the inference context's `key_value_memory_dict` on first
# use and writes each step's keys and values at the sequence offset (`:569-585`), for a static
# batch (`megatron/core/inference/contexts/static_context.py`) or a dynamic, paged one
# (`megatron/core/inference/contexts/dynamic_context.py`).
# tinytron's `generate` is deliberately the simplest form: one sequence, a cache allocated for
# the whole length up front, no paging and no batching of requests, and the whole model in one
# process (`tinytron-generate` reshards a checkpoint of any layout into it).
#
# ## Summary
#
# - Causal attention makes earlier positions independent of later tokens, so their keys and
#   values can be kept: a step with the cache is exact and runs one position per layer.
# - Prompt $p$, $n$ new tokens: $p + n - 1$ positions instead of $np + n(n-1)/2$; the cost is
#   $2 L g d$ elements per token (128 KiB in bf16 for the running example).
# - Greedy, temperature, top-k and top-p sampling choose the token; a seed makes it repeatable.
# - `tinytron-generate CHECKPOINT --prompt TEXT` does all of it on a trained checkpoint.
