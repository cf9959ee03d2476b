"""Chapter 05 on CUDA: the side-stream path of the buffers (skipped without a GPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
from tinytron.buffers._workers import TinyNet, lm_loss, make_batches
from tinytron.launch import run_on_ranks
from tinytron.parallel import ParallelGrid

from tests import buffers_workers as workers


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ddp_matches_autograd(dtype):
    """One GPU: buffers on CUDA, scaling on the side stream, main_grad == summed autograd grads."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    net = TinyNet().to(device=dev, dtype=dtype)
    plain = TinyNet().to(device=dev, dtype=dtype)
    plain.load_state_dict(net.state_dict())
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                        bucket_size=800, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(net, ParallelGrid.single(), cfg)
    assert ddp.comm_stream.stream is not None
    batches = make_batches(0, 2, 1, 3, micro_bs=2)[:, 0].to(dev)
    for step in range(2):
        ddp.zero_grad_buffer()
        for p in plain.parameters():
            p.grad = None
        acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in plain.named_parameters()}
        for m in range(3):
            with ddp.no_sync() if m < 2 else contextlib.nullcontext():
                lm_loss(ddp, batches[step, m]).backward()
            lm_loss(plain, batches[step, m]).backward()
            for n, p in plain.named_parameters():
                acc[n] += p.grad.float()
                p.grad = None
        ddp.finish_grad_sync()
        torch.cuda.synchronize()
        for (n, p) in net.named_parameters():
            assert p.main_grad.is_cuda and p.main_grad.dtype == torch.float32
            torch.testing.assert_close(p.main_grad, acc[n], rtol=1e-5, atol=1e-6)
        ddp.start_param_sync()  # one-rank all-gather: a no-op that must not break anything


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for an NCCL world")
def test_nccl_dp2_parity():
    cases = [
        dict(name="fp32 all-reduce, overlap, bucket 500",
             ddp=dict(overlap_grad_reduce=True, bucket_size=500)),
        dict(name="bf16 distopt, overlap grads+params, bucket 700", dtype=torch.bfloat16,
             ddp=dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=700,
                      overlap_param_gather=True)),
    ]
    per_rank = run_on_ranks(workers.parity_cases, 2, cases, False, backend="nccl", timeout=300)
    for case_ranks in zip(*(r["cases"] for r in per_rank)):
        tol = 3e-2 if case_ranks[0]["name"].startswith("bf16") else 1e-5
        for c in case_ranks:
            assert c["grad_err"] < tol and c["param_err"] < tol and not c["violations"], c["name"]
        assert torch.equal(case_ranks[0]["params"], case_ranks[1]["params"])
