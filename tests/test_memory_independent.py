"""Chapter 07's resident terms against things the ledger does not call.

The ledger (07.2) lays out the grad and param buffers and splits the offloaded optimizer with
Megatron's rules written out on its own page. Here the same layouts are built the way the
trainer builds them -- chapter 05's `ParamAndGradBuffer` (real tensors, its own
`compute_param_layout`), chapter 05's `default_bucket_size`, chapter 02's `split_by_fraction`
-- and compared to the byte. A mistake in either side is a disagreement; the last layout test
plants one in chapter 05 and checks that it is seen.

The second ruler, PyTorch's `MemTracker`, measures a handful of the 42 layouts of 07.6 in one
4-rank gloo world and is compared with the ledger (module fixture, one world start).
"""

from __future__ import annotations

import pytest
import torch

import tinytron.buffers.param_and_grad_buffer as ch05
from tinytron.buffers.bucket_group import default_bucket_size
from tinytron.buffers.distributed_data_parallel import DistributedDataParallelConfig
from tinytron.memory._workers import case_config
from tinytron.memory.states import (MemoryConfig, _optimizer_order, buffer_layouts,
                                    chunk_params, offloaded_mask, owned_elements, state_ledger)
from tinytron.model.config import tiny_config
from tinytron.optimizer.offload import split_by_fraction

# (case of 07.6's grid, world size): tied tables split over stages, odd DP sizes, small buckets
LAYOUTS = [({}, 4), ({"distopt": True}, 4), ({"distopt": True}, 3), ({"distopt": True}, 6),
           ({"distopt": True, "pp": 2, "m": 2}, 6),
           ({"distopt": True, "pp": 2, "vpp": 2, "num_layers": 4, "m": 4}, 4),
           ({"distopt": True, "overlap": True, "bucket_size": 20_000}, 4),
           ({"distopt": True, "overlap": True, "bucket_size": 7_000, "tp": 2, "pp": 2,
             "num_layers": 4, "m": 2}, 8),
           ({"overlap": True, "bucket_size": 20_000, "pp": 2, "m": 2}, 4),
           ({"distopt": True, "tie_embeddings": False, "cp": 2}, 4),
           ({"distopt": True, "bf16": False}, 4), ({"bf16": False}, 2),
           ({"distopt": True, "grad_fp32": False}, 4),
           ({"distopt": True, "offload": 0.5}, 4), ({"offload": 0.3, "pp": 2, "m": 2}, 4)]


def _chapter05_buffers(cfg: MemoryConfig, pp_rank: int):
    """The buffers chapter 05 allocates for this rank's chunks, from real parameter tensors."""
    dp = cfg.data_parallel_size * cfg.context_parallel_size
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=cfg.overlap_grad_reduce,
                                        bucket_size=cfg.bucket_size,
                                        use_distributed_optimizer=cfg.use_distributed_optimizer)
    bucket = default_bucket_size(ddp, dp) if pp_rank == 0 else None  # DDP's pp rule
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    grad_dtype = torch.float32 if cfg.grad_bytes == 4 else dtype
    out = []
    for chunk in range(cfg.num_chunks):
        specs = chunk_params(cfg, pp_rank, chunk)
        params = []
        for s in specs:
            p = torch.nn.Parameter(torch.zeros(s.count, dtype=dtype))
            p.shared_embedding = s.shared_embedding
            params.append(p)
        buf = ch05.ParamAndGradBuffer(params, param_dtype=dtype, grad_dtype=grad_dtype,
                                      dp_size=dp, bucket_size=bucket,
                                      use_distributed_optimizer=cfg.use_distributed_optimizer)
        out.append((specs, params, buf))
    return out


def _disagreements(cfg: MemoryConfig) -> list[str]:
    """Every place where the ledger's layout differs from chapter 05's buffers (empty: none)."""
    dp = cfg.data_parallel_size * cfg.context_parallel_size
    wrong = []
    for r in range(cfg.pipeline_model_parallel_size):
        ours = buffer_layouts(cfg, r)
        theirs = _chapter05_buffers(cfg, r)
        for (specs, layout), (_, params, buf) in zip(ours, theirs):
            if layout.bucket_indices != [(b.offset, b.offset + b.numel) for b in buf.buckets]:
                wrong.append(f"pp {r}: buckets {layout.bucket_indices} vs "
                             f"{[(b.offset, b.offset + b.numel) for b in buf.buckets]}")
            for s, p in zip(specs, params):
                if layout.param_index_map[s] != buf.param_index_map[p]:
                    wrong.append(f"pp {r}: {s.name} at {layout.param_index_map[s]} vs "
                                 f"{buf.param_index_map[p]}")
            if not cfg.use_distributed_optimizer:
                continue
            for d in range(dp):
                real = {id(x.param): 0 for b in buf.buckets for x in b.shard_param_ranges(d)}
                for b in buf.buckets:
                    for x in b.shard_param_ranges(d):
                        real[id(x.param)] += x.numel
                if owned_elements(specs, layout, dp, d) != [real.get(id(p), 0) for p in params]:
                    wrong.append(f"pp {r} dp {d}: owned elements differ")
        terms = state_ledger(cfg, r)
        grad = sum(b.grad_data.nbytes for _, _, b in theirs)
        weights = sum(b.param_data.nbytes if b.param_data is not None
                      else sum(p.nbytes for p in ps) for _, ps, b in theirs)
        if (terms["weights"], terms["grad_buffer"]) != (weights, grad):
            wrong.append(f"pp {r}: ledger weights/grad {terms['weights']}/{terms['grad_buffer']}"
                         f" B vs buffers {weights}/{grad} B")
    return wrong


@pytest.mark.parametrize("case,world", LAYOUTS)
def test_first_principles_layout_equals_chapter_05s_buffers(case, world):
    assert _disagreements(case_config(case, world)) == []


def test_a_bug_in_chapter_05s_layout_is_a_disagreement(monkeypatch):
    """The ledger no longer calls chapter 05: change 05's alignment and the test sees it."""
    cfg = case_config({"distopt": True, "num_query_groups": 1, "hidden_size": 72,
                       "num_attention_heads": 2}, 4)
    assert _disagreements(cfg) == []
    monkeypatch.setattr(ch05, "pad_param_start", lambda i: -(-i // 128) * 128)
    assert _disagreements(cfg)
    before = state_ledger(cfg)
    assert state_ledger(cfg) == before  # the ledger itself is untouched


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3, 0.5, 0.77, 1.0])
def test_offload_split_equals_chapter_02s(fraction):
    cfg = case_config({"distopt": True}, 4)
    for specs, layout in buffer_layouts(cfg, 0):
        for d in range(4):
            order = _optimizer_order(specs, owned_elements(specs, layout, 4, d))
            assert offloaded_mask(order, fraction) == split_by_fraction(order, fraction)


# ---- the second ruler: PyTorch's MemTracker on a handful of 07.6's layouts ----------------
TRACKED = [{}, {"distopt": True}, {"distopt": True, "offload": 0.5}, {"tp": 2, "sp": True},
           {"pp": 2, "m": 2, "distopt": True}, {"bf16": False}, {"dropout": 0.1},
           {"pp": 2, "vpp": 2, "m": 4, "num_layers": 4, "distopt": True}]


@pytest.fixture(scope="module")
def tracked():
    pytest.importorskip("torch.distributed._tools.mem_tracker")
    from tinytron.memory._second_ruler import run_tracked
    return run_tracked(TRACKED, world_size=4)


def test_memtracker_resident_equals_the_ledger(tracked):
    """Everything allocated from model build to after the first optimizer step, per rank."""
    wrong = []
    for r in tracked:
        cfg = case_config(r["case"], r["world_size"])
        predicted = sum(state_ledger(cfg, r["pp_rank"], r["dp_cp_rank"]).values())
        if r["resident"] != predicted:
            wrong.append((r["case"], r["rank"], r["resident"], predicted))
    assert not wrong, wrong
    assert len(tracked) == 4 * len(TRACKED)
    assert len({r["resident"] for r in tracked}) > 4  # the layouts differ, so do the numbers


def test_memtracker_kept_activations_equal_the_ledger(tracked):
    from tinytron.memory._workers import predict_chunk
    wrong = [(r["case"], r["rank"], r["tracked"]["kept"], predict_chunk(
                 case_config(r["case"], r["world_size"]), r["pp_rank"], 0)["kept"])
             for r in tracked]
    assert [w for w in wrong if w[2] != w[3]] == []


def test_memtracker_and_the_meter_agree_on_the_peaks(tracked):
    """The two instruments, same chunk, same micro-batch: forward and backward peaks."""
    for r in tracked:
        t, m = r["tracked"], r["meter"]
        assert (t["kept"], t["forward_peak"], t["backward_peak"]) == \
            (m["kept"], m["forward_peak"], m["backward_peak"]), (r["case"], r["rank"], t, m)
        assert t["forward_peak"] > t["kept"] > 0


@pytest.mark.gpu
def test_memtracker_on_cuda_against_the_ledger():
    """On one GPU (NCCL world of 1) the tracker rounds each storage up to 512 B, as the
    caching allocator does: the resident total is the ledger's plus that rounding."""
    from tinytron.memory._second_ruler import run_tracked
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cases = [{"hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 4,
              "ffn_hidden_size": 1024, "vocab_size": 4096, "seq_length": 512, "mbs": 2},
             {"hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 4,
              "ffn_hidden_size": 1024, "vocab_size": 4096, "seq_length": 512,
              "distopt": True, "bf16": False}]
    for r in run_tracked(cases, world_size=1, backend="nccl"):
        cfg = case_config(r["case"], 1, "cuda")
        predicted = sum(state_ledger(cfg, 0, 0).values())
        assert predicted <= r["resident"] <= predicted * 1.01, (r["case"], r["resident"], predicted)
        t, m = r["tracked"], r["meter"]
        assert abs(t["kept"] - m["kept"]) <= 0.01 * m["kept"], (r["case"], t, m)
