"""Chapter 00: label shift, Megatron masks and positions, SFT packing, the loss contract, GRPO."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tinytron.overview._tiny_model import TinyLM, build_demo_model
from tinytron.overview.batch import (ByteTokenizer, build_gpt_sample, get_ltor_masks_and_position_ids,
                                     mask_padding, shift_labels, split_into_samples)
from tinytron.overview.grpo import (GRPOConfig, completion_loss_mask, group_advantages, grpo_loss,
                                    grpo_loss_func, sample_completions, token_logprobs)
from tinytron.overview.loss import (forward_backward, lm_loss_func, microbatch_objective,
                                    reduce_reports, train_step)
from tinytron.overview.sft import (IGNORE_INDEX, block_causal_mask, pack_conversations,
                                   sft_rows_from_jsonl, tokenize_conversation)

TOK = ByteTokenizer()
EOD, PAD = TOK.eod, TOK.pad


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _reference_masks(data, eod, reset_pos, reset_attn, eod_mask):
    """Megatron's mask semantics written as the plain loop over EOD positions."""
    s = len(data)
    allowed = [[1.0 if k <= q else 0.0 for k in range(s)] for q in range(s)]
    loss = [0.0 if (eod_mask and t == eod) else 1.0 for t in data]
    pos = list(range(s))
    prev = 0
    for i in [j for j, t in enumerate(data) if t == eod]:
        if reset_attn:
            for q in range(i + 1, s):
                for k in range(i + 1):
                    allowed[q][k] = 0.0
        if reset_pos:
            for j in range(i + 1, s):
                pos[j] -= i + 1 - prev
            prev = i + 1
    masked = torch.tensor(allowed) < 0.5
    return masked, torch.tensor(loss), torch.tensor(pos)


# ---------------------------------------------------------------- label shift and masks

def test_label_shift_and_one_token_overlap():
    stream = torch.arange(1, 42)
    samples = split_into_samples(stream, 8)
    assert len(samples) == 5 and all(s.numel() == 9 for s in samples)
    for a, b in zip(samples, samples[1:]):
        ta, la = shift_labels(a)
        tb, _ = shift_labels(b)
        assert torch.equal(la[:-1], ta[1:])          # labels[i] == tokens[i+1]
        assert la[-1] == tb[0]                       # 1-token overlap with the next sample
    covered = torch.cat([shift_labels(s)[0] for s in samples])
    assert torch.equal(covered, stream[:40])         # every token is an input exactly once


def test_no_extra_token_rolls_and_pads_last_label():
    text = torch.tensor([5, 6, EOD, 7])
    sample = build_gpt_sample(text, EOD, PAD, add_extra_token_to_sequence=False)
    assert sample["tokens"].tolist() == [5, 6, EOD, 7]
    assert sample["labels"].tolist() == [6, EOD, 7, 0]  # pad label mapped to 0 for the embedding
    assert sample["loss_mask"].tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("flags", [(False, False, False), (True, True, True), (True, False, True),
                                   (False, True, False)])
def test_masks_match_megatron_loop(flags):
    g = torch.Generator().manual_seed(sum(flags) + 7)
    batch = torch.randint(0, 5, (3, 12), generator=g)
    batch[batch == 4] = EOD
    batch[0, 0], batch[1, -1] = EOD, EOD                 # EOD at the first and last position
    am, lm, pos = get_ltor_masks_and_position_ids(batch, EOD, *flags)
    assert am.shape == (3, 1, 12, 12) and am.dtype == torch.bool
    assert lm.dtype == torch.float32 and pos.dtype == torch.long
    for b in range(3):
        ref_am, ref_lm, ref_pos = _reference_masks(batch[b].tolist(), EOD, *flags)
        assert torch.equal(am[b, 0], ref_am)
        assert torch.equal(lm[b], ref_lm) and torch.equal(pos[b], ref_pos)
        one = get_ltor_masks_and_position_ids(batch[b], EOD, *flags)  # one sample: [1, s, s]
        assert one[0].shape == (1, 12, 12) and torch.equal(one[0][0], ref_am)


def test_mask_polarity_and_eod_reset_by_example():
    tokens = torch.tensor([10, EOD, 11, 12, EOD, 13])
    am, lm, pos = get_ltor_masks_and_position_ids(tokens, EOD, True, True, True)
    m = am[0]
    assert m[0, 1] and not m[1, 0] and not m[0, 0]   # True = blocked: the future is blocked
    assert m[2, 1] and m[2, 0] and not m[3, 2]       # doc 2 does not see doc 1 (its EOD included)
    assert m[5, 4] and not m[5, 5]
    assert pos.tolist() == [0, 1, 0, 1, 2, 0]
    assert lm.tolist() == [1, 0, 1, 1, 0, 1]          # loss at input EOD positions is masked
    causal, _, plain_pos = get_ltor_masks_and_position_ids(tokens, EOD)
    assert torch.equal(causal[0], torch.triu(torch.ones(6, 6, dtype=torch.bool), 1))
    assert plain_pos.tolist() == list(range(6))
    none_mask = get_ltor_masks_and_position_ids(tokens, EOD, create_attention_mask=False)[0]
    assert none_mask is None


def test_pad_masking_and_padding_sample():
    tokens, labels = torch.tensor([3, 4, PAD, PAD]), torch.tensor([4, PAD, PAD, PAD])
    t, l, m = mask_padding(tokens, labels, torch.ones(4), PAD)
    assert m.tolist() == [1, 0, 0, 0] and t.tolist() == [3, 4, 0, 0] and l.tolist() == [4, 0, 0, 0]
    sentinel = build_gpt_sample(torch.tensor([3, 4, 5, -1, -1]), EOD)   # Megatron's -1 pad
    assert sentinel["loss_mask"].tolist() == [1, 1, 0, 0] and (sentinel["tokens"] >= 0).all()
    filler = build_gpt_sample(torch.tensor([3, 4, 5, 6, 7]), EOD, PAD, is_padding_sample=True)
    assert filler["loss_mask"].sum() == 0 and filler["loss_mask"].shape == (4,)


def test_batch_bad_input():
    with pytest.raises(ValueError, match="shape"):
        get_ltor_masks_and_position_ids(torch.zeros(2, 2, 2, dtype=torch.long), EOD)
    with pytest.raises(ValueError, match="too short"):
        split_into_samples(torch.arange(4), 8)
    with pytest.raises(ValueError, match="unknown chat role"):
        TOK.role_id("tool")


# ---------------------------------------------------------------- SFT packing

def _chat(user, assistant, system=None):
    msgs = [{"role": "system", "content": system}] if system is not None else []
    return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def _segments(cu, s):
    return torch.bucketize(torch.arange(s), cu[1:].long(), right=True)


def test_sft_packing_never_attends_across_conversations():
    g = torch.Generator().manual_seed(0)
    chats = []
    for _ in range(30):
        n_u, n_a = torch.randint(0, 9, (2,), generator=g).tolist()
        chats.append(_chat("u" * n_u, "a" * n_a, system="s" if n_u % 2 else None))
    rows = pack_conversations(chats, 40, TOK)
    assert len(rows) > 3
    for row in rows:
        cu = row["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 40
        assert row["loss_mask"].dtype == torch.float32 and row["attention_mask"].dtype == torch.bool
        assert all(row[k].dtype == torch.int64 for k in ("tokens", "labels", "position_ids"))
        assert row["attention_mask"].shape == (1, 40, 40) and row["tokens"].shape == (40,)
        seg = _segments(cu, 40)
        allowed = ~row["attention_mask"][0]
        assert not (allowed & (seg[:, None] != seg[None, :])).any()      # never across
        causal_inside = torch.tril(torch.ones(40, 40, dtype=torch.bool)) & (seg[:, None] == seg[None, :])
        assert torch.equal(allowed, causal_inside)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert row["position_ids"][a:b].tolist() == list(range(b - a))   # reset per conversation
        assert row["max_seqlen"] == int((cu[1:] - cu[:-1]).max())
        assert set(row["loss_mask"].unique().tolist()) <= {0.0, 1.0}
        # the label of each segment's last input belongs to the next segment: always masked
        assert all(row["loss_mask"][b - 1] == 0 for b in cu[1:].tolist())


def test_sft_prompt_masking_and_targets():
    conv = _chat("2+2?", "4", system="be brief")
    tokens, targets = tokenize_conversation(conv, TOK)
    learned = [t for t in targets if t != IGNORE_INDEX]
    assert learned == TOK.encode("4") + [TOK.end_of_turn]
    row = pack_conversations([conv], 32, TOK)[0]
    assert TOK.decode(row["labels"][row["loss_mask"] == 1]) == "4<|end|>"
    assert (row["labels"] >= 0).all() and (row["tokens"] >= 0).all()
    n = len(tokens)
    assert torch.equal(row["tokens"][:n], torch.tensor(tokens))
    assert row["cu_seqlens"].tolist() == [0, n, 32]                  # padding is its own segment
    assert row["loss_mask"][n - 1:].sum() == 0                       # nothing trained on padding


def test_sft_jsonl_splits_on_system_and_packs_in_order():
    line = json.dumps({"messages": _chat("a", "b", "s1") + _chat("c", "d", "s2")})
    rows = sft_rows_from_jsonl([line + "\n", "\n", {"messages": _chat("e", "f")}], 16, TOK)
    lens = [r["cu_seqlens"].tolist() for r in rows]
    assert lens == [[0, 10, 16], [0, 10, 16]]          # 10 + 10 > 16; 10 + 6 fills a row exactly
    assert [TOK.decode(r["labels"][r["loss_mask"] == 1]) for r in rows] == [
        "b<|end|>", "d<|end|>f<|end|>"]


@pytest.mark.parametrize("record, match", [
    ('{"text": "hello"}', "no 'messages'"),
    ('{"messages": []}', "empty"),
    ("not json", "not valid JSON"),
    ('{"messages": [{"role": "user"}]}', "must be"),
    ('{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}',
     "unknown chat role"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant"),
])
def test_sft_bad_records_raise(record, match):
    with pytest.raises(ValueError, match=match):
        sft_rows_from_jsonl([record], 32, TOK)


def test_sft_overlong_conversation_raises_or_truncates():
    long = _chat("x" * 40, "y" * 10)
    with pytest.raises(ValueError, match="longer than the row"):
        pack_conversations([long], 32, TOK)
    with pytest.raises(ValueError, match="empty conversation"):
        tokenize_conversation([], TOK)
    with pytest.raises(ValueError, match="no conversations"):
        pack_conversations([], 32, TOK)
    rows = pack_conversations([_chat("a", "b"), long], 32, TOK, truncate=True)
    assert len(rows) == 2
    cut = rows[1]
    assert cut["cu_seqlens"].tolist() == [0, 32] and cut["loss_mask"].sum() == 0  # prompt only
    assert cut["tokens"][:33].tolist() == tokenize_conversation(long, TOK)[0][:32]
    with pytest.raises(ValueError, match="cu_seqlens"):
        block_causal_mask(torch.tensor([0, 5, 5, 8]), 8)


# ---------------------------------------------------------------- loss contract, normalization

def _tiny_lm(kind="TinyLM", seed=0):
    if kind == "GPTModel":
        return build_demo_model(vocab_size=32, seq_length=8, seed=seed, hidden_size=32,
                                num_layers=1, ffn_hidden_size=64)[0]
    return TinyLM(vocab_size=32, hidden=16, num_layers=1, heads=2, max_seq=8, seed=seed)



def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _mbs(keep, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(keep)
    tokens, labels = torch.randint(0, 32, (n, 8), generator=g), torch.randint(0, 32, (n, 8), generator=g)
    masks = torch.zeros(n, 8)
    for j, k in enumerate(keep):
        masks[j, :k] = 1
    return [{"tokens": tokens[j:j + 1], "labels": labels[j:j + 1], "loss_mask": masks[j:j + 1]}
            for j in range(n)]


def _merge(mbs):
    return [{k: torch.cat([m[k] for m in mbs]) for k in mbs[0]}]


def _grad_of(model, mbs, per_token):
    model.zero_grad(set_to_none=True)
    forward_backward(model, mbs, calculate_per_token_loss=per_token)
    return _grads(model)


def test_loss_contract_shapes_and_report():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    loss_sum, num_tokens, report = lm_loss_func(torch.tensor([[1, 1, 0, 1]]), per_token)
    assert loss_sum.dtype == torch.float32 and float(loss_sum) == 7.0
    assert num_tokens.dtype == torch.int32 and int(num_tokens) == 3
    assert report["lm loss"].tolist() == [7.0, 3.0]
    assert float(microbatch_objective(loss_sum, num_tokens, 2, False)) == pytest.approx(7 / 3 / 2)
    assert float(microbatch_objective(loss_sum, num_tokens, 2, True)) == 7.0
    zero = microbatch_objective(torch.tensor(0.0), torch.tensor(0, dtype=torch.int), 2, False)
    assert float(zero) == 0.0                                  # all-masked micro-batch: no 0/0
    pairs = [{"lm loss": torch.tensor([7.0, 3.0])}, {"lm loss": torch.tensor([1.0, 1.0])}]
    assert reduce_reports(pairs)["lm loss"] == pytest.approx(2.0)  # global token mean, not 1.67
    with pytest.raises(ValueError, match="loss_mask"):
        lm_loss_func(torch.ones(3), torch.ones(4))


@pytest.mark.parametrize("kind", ["TinyLM", "GPTModel"])
def test_normalization_equal_counts_split_invariant(kind):
    model = _tiny_lm(kind)
    mbs = _mbs([5, 5, 5, 5])
    whole = _grad_of(model, _merge(mbs), False)
    for split in (mbs, [_merge(mbs[:2])[0], _merge(mbs[2:])[0]]):
        assert torch.allclose(_grad_of(model, split, False), whole, rtol=1e-4, atol=1e-7)
        assert torch.allclose(_grad_of(model, split, True), whole, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", ["TinyLM", "GPTModel"])
def test_normalization_unequal_counts_differs_but_per_token_is_global_mean(kind):
    model = _tiny_lm(kind)
    mbs = _mbs([1, 7])
    whole = _grad_of(model, _merge(mbs), False)                # global token mean
    default = _grad_of(model, mbs, False)
    per_token = _grad_of(model, mbs, True)
    assert torch.allclose(per_token, whole, rtol=1e-4, atol=1e-7)
    assert float((default - whole).norm() / whole.norm()) > 0.05
    # default = mean over micro-batches of each one's token mean
    expected = 0.5 * _grad_of(model, mbs[:1], False) + 0.5 * _grad_of(model, mbs[1:], False)
    assert torch.allclose(default, expected, rtol=1e-4, atol=1e-7)


def test_train_step_moves_weights_and_reports():
    model = _tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_step(model, opt, _mbs([3, 8]), clip_grad=0.0)
    moved = math.sqrt(sum(float((p.detach() - b).pow(2).sum())
                          for p, b in zip(model.parameters(), before)))
    assert stats["num_tokens"] == 11 and stats["update_norm"] == pytest.approx(moved, rel=1e-5)
    assert stats["update_norm"] == pytest.approx(0.1 * stats["grad_norm"], rel=1e-4)  # SGD, no clip


# ---------------------------------------------------------------- GRPO

def _by_hand(cur, old, ref, adv, lo, hi, beta, ent=0.0, inf=None, trunc=None):
    """One token's GRPO loss with Python floats."""
    r = math.exp(cur - old)
    clipped = min(max(r, 1 - lo), 1 + hi)
    kl = math.exp(ref - cur) - (ref - cur) - 1
    h = -math.exp(cur) * cur
    w = 1.0 if inf is None else math.exp(old - inf)
    if inf is not None and trunc is not None:
        w = min(w, trunc)
    return -w * min(r * adv, clipped * adv) + beta * kl - ent * h


def test_grpo_loss_matches_hand_computation_with_both_clips_and_kl():
    ratios = torch.tensor([[1.1, 1.6, 0.5, 1.0], [1.1, 1.6, 0.5, 1.0]])
    old = torch.log(torch.tensor([[0.3, 0.4, 0.5, 0.2], [0.6, 0.1, 0.3, 0.5]]))
    cur = old + torch.log(ratios)
    ref = torch.log(torch.tensor([[0.2, 0.5, 0.5, 0.3], [0.5, 0.2, 0.4, 0.5]]))
    inf = old + torch.tensor([[0.1, -0.2, 0.9, 0.0], [-0.5, 0.3, 0.0, 1.2]])
    adv = torch.tensor([1.5, -0.75])
    for kwargs in [dict(), dict(entropy_weight=0.05, inference_logprobs=inf),
                   dict(inference_logprobs=inf, is_truncation_coef=1.5)]:
        out = grpo_loss(cur, old, ref, adv, 0.2, 0.3, 0.04, **kwargs)
        for b in range(2):
            for i in range(4):
                want = _by_hand(float(cur[b, i]), float(old[b, i]), float(ref[b, i]), float(adv[b]),
                                0.2, 0.3, 0.04, kwargs.get("entropy_weight", 0.0),
                                None if "inference_logprobs" not in kwargs else float(inf[b, i]),
                                kwargs.get("is_truncation_coef"))
                assert float(out["loss"][b, i]) == pytest.approx(want, abs=1e-5)
    assert out["clipped_above"].tolist() == [[False, True, False, False]] * 2
    assert out["clipped_below"].tolist() == [[False, False, True, False]] * 2
    assert (out["kl"] >= 0).all()
    # clipping on both sides, spelled out: A>0 caps the gain at 1+hi, A<0 caps it at 1-lo
    plain = grpo_loss(cur, old, ref, adv, 0.2, 0.3, 0.0)["loss"]
    assert float(plain[0, 1]) == pytest.approx(-1.3 * 1.5, abs=1e-5)   # r=1.6, A>0 -> 1.3
    assert float(plain[1, 2]) == pytest.approx(0.8 * 0.75, abs=1e-5)   # r=0.5, A<0 -> 0.8
    assert float(plain[0, 2]) == pytest.approx(-0.5 * 1.5, abs=1e-5)   # r=0.5, A>0: min keeps r
    assert float(plain[1, 1]) == pytest.approx(1.6 * 0.75, abs=1e-5)   # r=1.6, A<0: min keeps r


def test_grpo_gradient_at_ratio_one_is_policy_gradient():
    logp = torch.log(torch.tensor([[0.3, 0.6]])).requires_grad_(True)
    out = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([2.0]), 0.2, 0.2, 0.1)
    out["loss"].sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, -2.0]]))  # -A, KL grad is 0 at pi=ref


def test_group_advantages_and_loss_func_contract():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]]))
    std = math.sqrt(0.1875)
    assert adv[:4].tolist() == pytest.approx([0.75 / (1e-4 + std)] + [-0.25 / (1e-4 + std)] * 3)
    assert adv[4:].tolist() == [0.0] * 4                      # a uniform group teaches nothing
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.ones(4))
    loss = torch.tensor([[1.0, 2.0, 3.0]])
    parts = {k: torch.ones(1, 3) for k in ("kl", "ratios", "entropy", "clipped_above", "clipped_below")}
    loss_sum, num_tokens, report = grpo_loss_func(torch.tensor([[0.0, 1.0, 1.0]]), parts, loss)
    assert float(loss_sum) == 5.0 and int(num_tokens) == 2 and report["rl/kl"].tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(loss, loss, loss, torch.ones(2), 0.2, 0.2, 0.0)


def test_token_logprobs_and_rollout_masks():
    model = _tiny_lm("GPTModel")
    prompts = torch.randint(0, 30, (2, 3), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    seqs, logp, generated = sample_completions(model, prompts, 3, 4, end_id=31, pad_id=30, generator=g)
    assert seqs.shape == (6, 7) and logp.shape == (6, 4) and generated[:, 0].all()
    lp = token_logprobs(model(seqs), seqs)
    gen_part = lp[:, 2:]
    assert torch.allclose(gen_part[generated], logp[generated], atol=1e-5)  # sampler == trainer
    for row, live in zip(seqs[:, 3:].tolist(), generated.tolist()):
        if 31 in row:                                        # after <|end|>: pad and not trained
            e = row.index(31)
            assert all(t == 30 for t in row[e + 1:]) and not any(live[e + 1:])
    mask = completion_loss_mask(generated, 3)
    assert mask.shape == (6, 6) and mask[:, :2].sum() == 0
    # log-prob position t predicts token t+1: positions 2.. are the generated tokens, trained
    # exactly where the sampler says a token was generated (an inverted mask fails here)
    assert torch.equal(mask[:, 2:], generated.float())
    assert 0 < generated.sum() < generated.numel()  # both kinds of position are present


# ---------------------------------------------------------------- three modes, one train_step

def test_pretrain_sft_rl_each_take_a_real_step_through_train_step():
    import copy

    from tinytron.overview.loss import pretrain_forward_step
    from tinytron.overview.modes import (addition_problems, collect_rollouts, pretrain_microbatches,
                                         rl_forward_step, sft_microbatches)

    model, name = build_demo_model(vocab_size=TOK.vocab_size, seq_length=32, seed=5)
    problems = addition_problems(2)
    ref = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    batches = {
        "pretrain": (pretrain_microbatches(problems, TOK, 16, 2), pretrain_forward_step),
        "sft": (sft_microbatches(problems, TOK, 32, 2), pretrain_forward_step),
        "rl": ([collect_rollouts(model, ref, problems, TOK, 4, generator=g)], rl_forward_step),
    }
    rollout = batches["rl"][0][0]
    # an untrained model rarely earns a reward; fixed advantages make the policy-gradient path live
    rollout["advantages"] = torch.linspace(-1.0, 1.0, rollout["tokens"].shape[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for mode, (mbs, step_fn) in batches.items():
        before = [p.detach().clone() for p in model.parameters()]
        stats = train_step(model, opt, mbs, step_fn)
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
        assert math.isfinite(stats["lm loss"]) and stats["num_tokens"] > 0, (mode, stats)
        assert moved > 0 and stats["grad_norm"] > 0, mode
    assert "rl/kl" in stats and stats["rl/kl"] >= 0


def test_grpo_config_defaults_and_checks():
    c = GRPOConfig()
    assert (c.group_size, c.prompts_per_step, c.grpo_iterations, c.clamp_eps_lower,
            c.clamp_eps_upper, c.kl_beta, c.entropy_weight) == (2, 32, 2, 0.01, 0.01, 0.001, 0.0)
    assert c.inference_logprobs_is_correction is False and c.is_truncation_coef is None
    with pytest.raises(ValueError, match="grpo_iterations"):
        GRPOConfig(grpo_iterations=0)
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="clip range"):
        GRPOConfig(clamp_eps_lower=1.5)
