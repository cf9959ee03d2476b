"""Appendix B: config checks, exact counts, RoPE/RMSNorm, and every layout against one process."""

import math

import pytest
import torch

from tinytron.launch import run_on_ranks
from tinytron.model import _workers
from tinytron.model.config import (count_parameters, count_parameters_per_rank,
                                   llama_7b_config, stage_layer_ranges, tiny_config)
from tinytron.model.gpt import GPTModel, build_stage_models
from tinytron.model.layers import (RMSNorm, ShardSpec, apply_rope, init_full_tensor, rope_cos_sin,
                                   shard_of, unshard)

TOL = 1e-5  # fp32: the gaps measured are ~1e-6 (reduction order only)


def test_7b_counts_total_and_per_rank():
    big = llama_7b_config()
    assert count_parameters(big) == 7_504_924_672
    assert count_parameters(big.replace(tie_embeddings=False)) == 8_030_261_248
    # TP2 x PP2: first stage = 16 layers/2 + embedding/2; last adds final norm + tied copy.
    assert count_parameters_per_rank(big, tp=2, pp=2, pp_rank=0) == 2_007_629_824
    assert count_parameters_per_rank(big, tp=2, pp=2, pp_rank=1) == 2_007_633_920
    assert count_parameters_per_rank(big.replace(tie_embeddings=False), tp=1) == 8_030_261_248
    assert count_parameters_per_rank(big, tp=1) == 7_504_924_672


def test_tiny_model_holds_exactly_the_counted_parameters():
    for tie in (True, False):
        config = tiny_config(tie_embeddings=tie)
        model = GPTModel(config)
        assert sum(p.numel() for p in model.parameters()) == count_parameters(config)


@pytest.mark.parametrize("overrides, layout, field", [
    (dict(num_attention_heads=6, num_query_groups=6, hidden_size=96), dict(tp=4),
     "num_attention_heads"),
    (dict(num_query_groups=4, num_attention_heads=6, hidden_size=96), {}, "num_query_groups"),
    (dict(num_query_groups=1), dict(tp=2), "num_query_groups"),
    (dict(seq_length=60), dict(cp=4), "seq_length"),
    (dict(num_layers=3), dict(pp=2), "num_layers"),
    (dict(vocab_size=509), dict(tp=2), "vocab_size"),
    (dict(ffn_hidden_size=130, num_query_groups=4), dict(tp=4), "ffn_hidden_size"),
    (dict(hidden_size=66), {}, "hidden_size"),
    (dict(dropout=1.5), {}, "dropout"),
    (dict(num_layers=0), {}, "num_layers"),
])
def test_bad_configs_name_the_field(overrides, layout, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides).check_layout(**layout)


def test_world_size_mismatch_is_a_value_error():
    from tinytron.parallel import rank_layout

    with pytest.raises(ValueError, match="tp"):
        rank_layout(4, tp=3)


def test_stage_layer_ranges_interleave():
    assert stage_layer_ranges(8, pp=2, num_virtual_stages=2, pp_rank=1) == [(2, 4), (6, 8)]
    assert stage_layer_ranges(4, pp=1) == [(0, 4)]


def test_rope_is_relative_and_rotate_half():
    d = 8
    q, k = torch.randn(1, 1, d), torch.randn(1, 1, d)

    def score(m, n):
        cq, sq = rope_cos_sin(torch.tensor([m]), d)
        ck, sk = rope_cos_sin(torch.tensor([n]), d)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    assert torch.allclose(score(7, 3), score(40, 36), atol=1e-5)
    cos, sin = rope_cos_sin(torch.tensor([1]), 4)
    out = apply_rope(torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]), cos, sin).flatten()
    assert torch.allclose(out, torch.tensor([math.cos(1), 0.0, math.sin(1), 0.0]))


def test_rmsnorm_matches_formula():
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_()
        x = torch.randn(3, 16)
        ref = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.allclose(norm(x), ref, atol=1e-6)


def test_init_is_layout_free_and_shards_invert():
    spec = ShardSpec((8, 4), dim=0, chunks=2)
    full = init_full_tensor(spec, 1234, "w")
    assert torch.equal(full, init_full_tensor(spec, 1234, "w"))
    assert not torch.equal(full, init_full_tensor(spec, 1234, "v"))
    for tp in (1, 2, 4):
        assert torch.equal(unshard([shard_of(full, spec, r, tp) for r in range(tp)], spec), full)


def test_attention_mask_and_positions_checked():
    model = GPTModel(tiny_config())
    tokens = torch.zeros(2, 64, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask"):
        model(tokens, attention_mask=torch.zeros(2, 64, 64, dtype=torch.bool))
    with pytest.raises(ValueError, match="position_ids"):
        model(tokens, position_ids=torch.zeros(2, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        model(tokens, labels=torch.zeros(2, 32, dtype=torch.long))
    stage = build_stage_models(tiny_config())[0]
    assert stage.pre_process and stage.post_process


def test_packed_mask_isolates_documents():
    """With an EOD-reset mask and positions, a document's logits do not depend on the one before."""
    config = tiny_config()
    model = GPTModel(config)
    tokens, _, pos, mask = _workers.packed_batch(config)
    other = tokens.clone()
    other[1, : 29] = (other[1, : 29] + 7) % config.vocab_size  # change row 1's first document
    a = model(tokens, position_ids=pos, attention_mask=mask)
    b = model(other, position_ids=pos, attention_mask=mask)
    assert torch.allclose(a[1, 29:], b[1, 29:], atol=1e-5)
    assert not torch.allclose(a[1, :29], b[1, :29])


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tp2_pp2")
    return run_on_ranks(_workers.all_layouts, 4, str(folder), timeout=240)


@pytest.mark.parametrize("name", ["tp2_cp1_sp0_packed0", "tp2_cp1_sp1_packed1",
                                  "tp1_cp2_sp0_packed1", "tp2_cp2_sp1_packed1",
                                  "tp2_cp2_sp0_packed0"])
def test_tp_cp_layouts_match_single_process(layouts, name):
    for rank_out in layouts:
        r = rank_out[name]
        assert r["logits_gap"] < TOL and r["loss_gap"] < TOL and r["grad_gap"] < TOL, r
        assert r["num_params"] == r["expected_params"]


@pytest.mark.parametrize("name", ["pp2", "pp2_tp2_sp", "pp2_vpp2"])
def test_pipeline_split_matches_unsplit(layouts, name):
    for rank, rank_out in enumerate(layouts):
        r = rank_out[name]
        assert r["grad_gap"] < TOL, r
        assert r["num_params"] == r["expected_params"]
        if "loss_gap" in r:
            assert r["loss_gap"] < TOL
    losses = [o[name] for o in layouts if "loss_gap" in o[name]]
    assert len(losses) == len(layouts) // 2  # only the last stage computes the loss


def test_tied_embedding_attributes_across_stages(layouts):
    first, last = layouts[0]["pp2"]["shared"], layouts[-1]["pp2"]["shared"]
    assert first == [("embedding.word_embeddings.weight", False, True)]
    assert last == [("output_layer.weight", True, True)]


@pytest.mark.parametrize("name", ["dropout_sp0", "dropout_sp1"])
def test_dropout_draws_agree_across_tp(layouts, name):
    for rank_out in layouts:
        r = rank_out[name]
        assert r["tp_ranks_agree"] and r["train_differs"] and r["eval_gap"] == 0.0, r
        assert 0.1 < r["dropped_fraction"] < 0.3, r  # dropout 0.2 really ran
        if name == "dropout_sp0":  # one replicated stream: every TP rank computed the same thing
            assert r["decoder_outputs_agree"] and r["embedding_masks_agree"], r
        else:  # SP: each rank draws its own chunk's mask from its own stream
            assert not r["embedding_masks_agree"], r


def test_hf_export_from_tp2_pp2_and_import_into_tp2_and_pp2(layouts):
    for rank_out in layouts:
        r = rank_out["hf"]
        assert r["file_equal"] and r["shards_equal"] and r["logits_gap"] < TOL, r
        assert r["pp_loss_gap"] < TOL, r


@pytest.mark.gpu
def test_cuda_model_matches_cpu_and_runs_bf16():
    config = tiny_config()
    tokens = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    cpu, gpu = GPTModel(config), GPTModel(config, device="cuda")
    assert all(p.is_cuda for p in gpu.parameters())
    with torch.no_grad():
        assert torch.allclose(gpu(tokens.cuda()).cpu(), cpu(tokens), atol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = gpu(tokens.cuda(), labels=tokens.cuda())
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()


def test_bf16_params_and_stage_shape():
    config = tiny_config(sequence_parallel=True)
    tokens = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    fp32, bf16 = GPTModel(config), GPTModel(config, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    with torch.no_grad():
        loss32, loss16 = fp32(tokens, labels=tokens), bf16(tokens, labels=tokens)
    assert loss16.dtype == torch.float32 and abs(float(loss16.mean() - loss32.mean())) < 0.05
    from tinytron.model.gpt import stage_tensor_shape
    from tinytron.parallel import ParallelGrid

    assert stage_tensor_shape(config, ParallelGrid.single(), 2) == (64, 2, 64)


@pytest.mark.parametrize("pre, post, tie", [(True, True, True), (True, True, False),
                                            (True, False, True), (False, True, True),
                                            (False, True, False)])
def test_every_weight_is_used_inside_a_call_of_its_module(pre, post, tie):
    """Forward pre-hooks (chapter 05's overlapped param all-gather) see every parameter used.

    A weight read outside its module's call would be used before the hook that waits for its
    all-gather: the output matrix of a last pipeline stage once was, and the losses drifted.
    """
    config = tiny_config(tie_embeddings=tie)
    model = GPTModel(config, pre_process=pre, post_process=post, layer_range=(0, 2))
    seen = set()
    for m in model.modules():
        m.register_forward_pre_hook(lambda mod, args: seen.update(map(id, mod.parameters(False))))
    b, s = 2, config.seq_length
    if not pre:
        model.set_input_tensor(torch.randn(s, b, config.hidden_size))
    tokens = torch.randint(0, config.vocab_size, (b, s))
    model(tokens if pre else None, labels=tokens if post else None)
    unseen = [n for n, p in model.named_parameters() if id(p) not in seen]
    assert not unseen, f"used outside a module call (no pre-hook ran): {unseen}"


@pytest.mark.parametrize("pre, post, tie, flagged", [
    (True, True, True, ["embedding.word_embeddings.weight"]),
    (True, True, False, ["embedding.word_embeddings.weight", "output_layer.weight"]),
    (True, False, True, ["embedding.word_embeddings.weight"]),
    (False, False, True, []),
    (False, True, True, ["output_layer.weight"]),      # the tied copy on the last stage
    (False, True, False, ["output_layer.weight"])])
def test_decoupled_lr_reaches_the_embedding_and_output_weights(pre, post, tie, flagged):
    """Megatron's is_embedding_or_output_parameter, per stage; the decoupled lr follows it."""
    from tinytron.optimizer.algorithms import build_param_groups

    config = tiny_config(tie_embeddings=tie)
    model = GPTModel(config, pre_process=pre, post_process=post, layer_range=(0, 2))
    marked = [n for n, p in model.named_parameters()
              if getattr(p, "is_embedding_or_output_parameter", False)]
    assert marked == flagged
    groups = build_param_groups(model.named_parameters(), lr=3e-4, decoupled_lr=1e-4,
                                decoupled_min_lr=1e-5)
    decoupled = sorted(n for g in groups if g["is_decoupled_lr"] for n in g["param_names"])
    assert decoupled == sorted(flagged)
    assert all((g["max_lr"], g["min_lr"]) == ((1e-4, 1e-5) if g["is_decoupled_lr"] else (3e-4, 0.0))
               for g in groups)


# -- RoPE from cached tables, and the full-vocabulary loss -------------------------------------
def test_rope_on_strided_views_is_the_complex_rotation_of_each_pair():
    """apply_rope on q/k views of a fused QKV = (x1 + i x2) e^{i m theta}; the grad rotates back."""
    s, b, d = 32, 3, 16
    pos = torch.randint(0, 200, (b, s))
    base = torch.randn(s, b, 2, 5, d, dtype=torch.float64)
    x = base[:, :, :, 1:4].reshape(s, b, 6, d).requires_grad_()  # q-like, from a fused QKV
    k = base[:, :, :, 4].requires_grad_()                          # k-like: a strided view
    cos, sin = (t.transpose(0, 1) for t in rope_cos_sin(pos, d, dtype=torch.float64))
    theta = pos.t().unsqueeze(-1).double() * 10000.0 ** (-torch.arange(0, d, 2).double() / d)
    turn = torch.polar(torch.ones_like(theta), theta).unsqueeze(-2)     # [s, b, 1, d/2]
    tol = dict(rtol=0, atol=5e-5)  # the tables' angles are fp32: m theta to ~m 2^-24 at m < 200
    for inp in (x, k):
        y = apply_rope(inp, cos, sin)
        z = torch.complex(inp[..., : d // 2], inp[..., d // 2:]) * turn
        torch.testing.assert_close(y, torch.cat((z.real, z.imag), -1), **tol)
        grad = torch.randn_like(y)
        gz = torch.complex(grad[..., : d // 2], grad[..., d // 2:]) * turn.conj()
        torch.testing.assert_close(torch.autograd.grad(y, inp, grad)[0],
                                   torch.cat((gz.real, gz.imag), -1), **tol)


def test_rope_tables_are_cached_and_default_positions_use_them():
    config = tiny_config()
    model = GPTModel(config)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length))
    hidden = torch.zeros(config.seq_length, 2, config.hidden_size)
    first = model._rope_tables(hidden, None)
    assert model._rope_tables(hidden, None)[0] is first[0]  # built once per length
    assert first[0].shape == (config.seq_length, 1, config.head_dim)
    default = torch.arange(config.seq_length).expand(2, -1)
    assert model._rope_tables(hidden, default)[0] is first[0]
    # positions that restart (packed documents) get their own tables, and their own logits
    packed = torch.cat([torch.arange(20), torch.arange(config.seq_length - 20)]).expand(2, -1)
    assert model._rope_tables(hidden, packed)[0].shape == (config.seq_length, 2, config.head_dim)
    with torch.no_grad():
        plain, same = model(tokens), model(tokens, position_ids=default.clone())
        other = model(tokens, position_ids=packed)
    assert torch.equal(plain, same) and not torch.equal(plain, other)


def test_rope_cache_filled_under_inference_still_trains():
    config = tiny_config()
    model = GPTModel(config)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length))
    with torch.inference_mode():
        model(tokens)
    model(tokens, labels=tokens).mean().backward()   # would fail on inference tensors
    assert model.embedding.word_embeddings.weight.grad is not None
