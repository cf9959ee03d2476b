"""Appendix A without a process group: rank layouts, the single grid, CP index maths, RNG tracker."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinytron.parallel import (DATA_PARALLEL_RNG, EXPERT_PARALLEL_RNG, MODEL_PARALLEL_RNG,
                               ColumnParallelLinear, ParallelGrid, RNGStatesTracker, RowParallelLinear,
                               VocabParallelEmbedding, context_parallel_attention, cp_chunk_ids,
                               cp_positions, model_parallel_seed, normal_init, padded_vocab_size,
                               rank_layout, restore_sequence_order, set_random_seed,
                               slice_batch_for_context_parallel, vocab_parallel_cross_entropy)


# --- grid layout -------------------------------------------------------------------------------

def test_megatron_documented_16_rank_example():
    """initialize_model_parallel's docstring (parallel_state.py:683-693): tp 2, pp 4 on 16 ranks."""
    lay = rank_layout(16, tp=2, pp=4)
    assert lay.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lay.groups["embd"] == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_eight_rank_groups_tp2_cp2_pp2():
    """Rank = tp + 2*(cp + 2*(dp + 1*pp)) with dp 1: the expected rank lists of every axis."""
    lay = rank_layout(8, tp=2, cp=2, pp=2)
    assert lay.sizes == {"tp": 2, "cp": 2, "dp": 1, "pp": 2}
    assert lay.groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups["dp"] == [[r] for r in range(8)]
    assert lay.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups["dp_cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lay.groups["embd"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords[5] == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}


def test_eight_rank_groups_tp2_dp2_pp2_and_tp4_dp2():
    lay = rank_layout(8, tp=2, pp=2)
    assert lay.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups["dp_cp"] == lay.groups["dp"]
    assert lay.groups["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    lay = rank_layout(8, tp=4)
    assert lay.groups["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and lay.groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups["embd"] == [[r] for r in range(8)]  # pp 1: each rank is its own first+last stage


def test_every_axis_partitions_the_world():
    lay = rank_layout(24, tp=2, cp=3, pp=2)
    for axis, groups in lay.groups.items():
        if axis != "embd":
            assert sorted(r for g in groups for r in g) == list(range(24)), axis


def test_other_order_changes_neighbours():
    lay = rank_layout(8, tp=2, pp=2, order="tp-pp-dp")
    assert lay.groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("kwargs,words", [
    (dict(world_size=8, tp=3), ["world_size 8", "tp*cp*pp", "3"]),
    (dict(world_size=8, tp=2, pp=2, dp=3), ["2*1*3*2", "12", "world_size 8"]),
    (dict(world_size=8, tp=0), ["tp", "0"]),
    (dict(world_size=8, cp=2, order="tp-dp-pp"), ["order", "tp-dp-pp"]),
])
def test_bad_sizes_raise_value_error_naming_them(kwargs, words):
    with pytest.raises(ValueError) as err:
        rank_layout(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_single_grid_needs_no_process_group():
    g = ParallelGrid.single()
    for axis in ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "mp", "embd"):
        assert g.size(axis) == 1 and g.rank(axis) == 0 and g.group(axis) is None and g.ranks(axis) == [0]
    assert g.is_first_stage() and g.is_last_stage() and g.world_size == 1 and g.global_rank == 0
    x = torch.ones(2)
    assert g.all_reduce(x, "tp") is x and x.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="unknown axis 'ep'"):
        g.size("ep")


def test_grid_without_process_group_raises():
    with pytest.raises(ValueError, match="init_process_group"):
        ParallelGrid(tp=2)


# --- layers on one rank ------------------------------------------------------------------------

def test_single_rank_layers_equal_torch():
    g = ParallelGrid.single()
    col = ColumnParallelLinear(6, 4, g, init_method=normal_init(0.1, 1))
    row = RowParallelLinear(4, 6, g, init_method=normal_init(0.1, 2))
    emb = VocabParallelEmbedding(10, 6, g, init_method=normal_init(1.0, 3))
    x = torch.randn(3, 2, 6)
    assert torch.allclose(col(x), F.linear(x, col.weight, col.bias))
    assert torch.allclose(row(x[..., :4]), F.linear(x[..., :4], row.weight, row.bias))
    tokens = torch.tensor([[0, 9, 3]])
    assert torch.equal(emb(tokens), emb.weight[tokens])
    logits, labels = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
    assert torch.allclose(vocab_parallel_cross_entropy(logits, labels, g),
                          F.cross_entropy(logits.transpose(1, 2), labels, reduction="none"), atol=1e-6)


def test_cross_entropy_accepts_int32_labels():
    g = ParallelGrid.single()
    logits, labels = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
    assert torch.allclose(vocab_parallel_cross_entropy(logits, labels.int(), g),
                          vocab_parallel_cross_entropy(logits, labels, g))


def test_p2p_on_a_single_stage_raises():
    from tinytron.parallel import communicate, recv_forward, send_forward

    g = ParallelGrid.single()
    assert recv_forward((2, 3), g) is None  # the first stage has no previous stage
    send_forward(torch.ones(2), g)  # the last stage sends nothing
    with pytest.raises(ValueError, match="more than 1 rank"):
        communicate(g, send_next=torch.ones(2))


def test_cross_entropy_bf16_logits_give_fp32_loss_and_bf16_grad():
    g = ParallelGrid.single()
    logits = torch.randn(2, 3, 10).bfloat16().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(logits, torch.randint(0, 10, (2, 3)), g)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16


def test_layer_shape_errors_name_the_field():
    g = ParallelGrid.single()
    with pytest.raises(ValueError, match="logits"):
        vocab_parallel_cross_entropy(torch.randn(2, 3, 10), torch.zeros(2, 4, dtype=torch.long), g)
    with pytest.raises(ValueError, match="sequence_parallel"):
        RowParallelLinear(4, 4, g, input_is_parallel=False, sequence_parallel=True)
    assert padded_vocab_size(50257, 1) == 50304 and padded_vocab_size(128256, 8) == 129024


# --- context parallel index maths --------------------------------------------------------------

def test_cp_chunks_and_positions():
    assert [cp_chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert cp_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    every = torch.cat([cp_positions(16, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by 2\\*cp = 8"):
        cp_positions(12, 4, 0)


def test_restore_sequence_order_inverts_the_split():
    t = torch.arange(2 * 16).reshape(2, 16)
    gathered = torch.cat([t[:, cp_positions(16, 4, r)] for r in range(4)], dim=1)
    assert torch.equal(restore_sequence_order(gathered, 4, seq_dim=1), t)


def test_slice_batch_on_single_grid_is_identity_and_mask_uses_dim_2():
    g = ParallelGrid.single()
    batch = {"tokens": torch.arange(8).reshape(1, 8), "attention_mask": torch.ones(1, 1, 8, 8), "x": None}
    out = slice_batch_for_context_parallel(batch, g)
    assert out["tokens"] is batch["tokens"] and out["x"] is None


def test_single_grid_attention_is_sdpa_with_gqa():
    g = ParallelGrid.single()
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(context_parallel_attention(q, k, v, g), ref)
    with pytest.raises(ValueError, match="kv heads"):
        context_parallel_attention(torch.randn(1, 3, 6, 8), k, v, g)


# --- RNG tracker -------------------------------------------------------------------------------

def test_fork_leaves_the_default_stream_untouched():
    tr = RNGStatesTracker("cpu")
    tr.add("a", 11)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    with tr.fork("a"):
        inside = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(inside, torch.rand(4, generator=torch.Generator().manual_seed(11)))


def test_fork_continues_its_stream_and_states_replay():
    tr = RNGStatesTracker("cpu")
    tr.add("a", 5)
    ref = torch.rand(6, generator=torch.Generator().manual_seed(5))
    saved = tr.get_states()
    with tr.fork("a"):
        first = torch.rand(3)
    with tr.fork("a"):
        second = torch.rand(3)
    assert torch.equal(torch.cat([first, second]), ref)
    tr.set_states(saved)
    with tr.fork("a"):
        assert torch.equal(torch.rand(3), first)


def test_nested_fork_equals_sequential_forks():
    def draws(nested: bool):
        tr = RNGStatesTracker("cpu")
        tr.add("a", 1)
        tr.add("b", 2)
        if nested:
            with tr.fork("a"):
                x = torch.rand(2)
                with tr.fork("b"):
                    y = torch.rand(2)
                z = torch.rand(2)
        else:
            with tr.fork("a"):
                x = torch.rand(2)
            with tr.fork("b"):
                y = torch.rand(2)
            with tr.fork("a"):
                z = torch.rand(2)
        return torch.cat([x, y, z])
    assert torch.equal(draws(True), draws(False))


def test_tracker_errors():
    tr = RNGStatesTracker("cpu")
    tr.add("a", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tr.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tr.add("b", 1)
    with pytest.raises(ValueError, match="'c' was never added"):
        with tr.fork("c"):
            pass
    with pytest.raises(ValueError, match="cpu or cuda"):
        RNGStatesTracker("meta")


def test_megatron_seed_offsets():
    g = ParallelGrid.single()
    tr = model_parallel_seed(1234, g, RNGStatesTracker("cpu"))
    assert set(tr.get_states()) == {DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG}
    for name, seed in ((MODEL_PARALLEL_RNG, 1234 + 2718), (DATA_PARALLEL_RNG, 1234),
                       (EXPERT_PARALLEL_RNG, 1234 + 1024)):
        with tr.fork(name):
            got = torch.rand(3)
        assert torch.equal(got, torch.rand(3, generator=torch.Generator().manual_seed(seed))), name
    assert set_random_seed(1234, g, tracker=RNGStatesTracker("cpu")) == 1234  # pp rank 0: no offset
    with pytest.raises(ValueError, match="seed must be a positive int"):
        set_random_seed(0, g)


@pytest.mark.gpu
def test_cuda_tracker_forks_the_cuda_generator():
    tr = RNGStatesTracker("cuda")
    tr.add("a", 3)
    torch.cuda.manual_seed(0)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(0)
    cpu_before = torch.get_rng_state()
    with tr.fork("a"):
        inside = torch.rand(4, device="cuda")
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    assert torch.equal(torch.get_rng_state(), cpu_before)
    assert torch.equal(inside, torch.rand(4, device="cuda", generator=torch.Generator("cuda").manual_seed(3)))


@pytest.mark.gpu
def test_single_grid_layers_on_cuda_match_cpu():
    g = ParallelGrid.single()
    x = torch.randn(4, 2, 8)
    outs = []
    for device in ("cpu", "cuda"):
        col = ColumnParallelLinear(8, 6, g, init_method=normal_init(0.1, 1), device=device)
        row = RowParallelLinear(6, 8, g, init_method=normal_init(0.1, 2), device=device)
        y = row(torch.tanh(col(x.to(device))))
        logits = y.reshape(8, 8)
        loss = vocab_parallel_cross_entropy(logits, torch.arange(8, device=device) % 8, g)
        q = y.permute(1, 0, 2).unsqueeze(1)  # [b, 1 head, s, d]
        att = context_parallel_attention(q, q, q, g)
        outs.append((y.cpu(), loss.cpu(), att.cpu()))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-4)
