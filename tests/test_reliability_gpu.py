"""Full-iteration CUDA graph: graphed losses equal eager ones; static buffers; refusal on CPU."""

from __future__ import annotations

import time

import pytest
import torch

from tinytron.reliability.full_cuda_graph import (FullCudaGraphUnavailable, FullCudaGraphWrapper)

MICRO, MBS, SEQ, ITERS = 4, 2, 32, 10


def _forward_backward(forward_step_func=None, data_iterator=None, model=None, num_microbatches=1,
                      seq_length=None, micro_batch_size=None, forward_only=False, **_):
    """Gradient accumulation over the micro-batches, Megatron's schedule signature."""
    losses = []
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        loss = model[0](batch["tokens"], labels=batch["labels"]).float().mean()
        if not forward_only:
            (loss / num_microbatches).backward()
        losses.append({"lm loss": loss.detach()})
    return losses


def _batches(iters: int, micro: int = MICRO):
    """iters steps of micro CPU batches {tokens, labels} [MBS, SEQ], from one seeded generator."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(iters):
        step = []
        for _ in range(micro):
            t = torch.randint(0, 512, (MBS, SEQ), generator=g)
            step.append({"tokens": t, "labels": torch.roll(t, -1, 1)})
        out.append(step)
    return out


def _train(graphed: bool, iters: int = ITERS):
    from tinytron.model import GPTModel, tiny_config

    torch.manual_seed(0)
    model = GPTModel(tiny_config()).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    FullCudaGraphWrapper.reset_cuda_graph()  # the graphs live on the class: start from none
    fb = FullCudaGraphWrapper(_forward_backward, cuda_graph_warmup_steps=3) if graphed \
        else _forward_backward
    losses, seconds, addresses = [], [], []
    for step in _batches(iters):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()       # in place: the graph keeps writing into these tensors
        data = iter(step) if graphed else iter([{k: v.cuda() for k, v in b.items()} for b in step])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reports = fb(forward_step_func=None, data_iterator=data, model=[model],
                     num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS,
                     forward_only=False)
        losses.append(torch.stack([r["lm loss"] for r in reports]).cpu())  # consume now
        if graphed:
            addresses.append(fb.loader.buffers["training"][0]["tokens"].data_ptr())
        opt.step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return torch.stack(losses), seconds, (fb, addresses)


@pytest.mark.gpu
def test_graphed_iterations_equal_eager_and_report_the_speedup():
    eager, t_eager, _ = _train(graphed=False)
    graphed, t_graph, (wrapper, addresses) = _train(graphed=True)
    assert wrapper.graphs["training"] is not None and wrapper.calls["training"] == ITERS
    assert len(addresses) == ITERS and len(set(addresses)) == 1   # every batch, same storage
    diff = (eager - graphed).abs().max().item()
    print(f"max |eager - graphed| loss over {ITERS} iterations x {MICRO} micro-batches: {diff:.3e}"
          f" (bitwise equal: {torch.equal(eager, graphed)})")
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=0)
    steady_eager = sum(t_eager[4:]) / len(t_eager[4:])
    steady_graph = sum(t_graph[4:]) / len(t_graph[4:])
    print(f"forward-backward + step: eager {1e3 * steady_eager:.2f} ms, graphed "
          f"{1e3 * steady_graph:.2f} ms, speed-up {steady_eager / steady_graph:.2f}x")


@pytest.mark.gpu
def test_validation_graph_is_separate_from_training():
    from tinytron.model import GPTModel, tiny_config

    model = GPTModel(tiny_config()).cuda()
    FullCudaGraphWrapper.reset_cuda_graph()
    wrapper = FullCudaGraphWrapper(_forward_backward, cuda_graph_warmup_steps=1)
    step = _batches(1)[0]
    for _ in range(3):
        with torch.no_grad():
            wrapper(data_iterator=iter(step), model=[model], num_microbatches=MICRO,
                    forward_only=True)
    assert wrapper.graphs["validation"] is not None and wrapper.graphs["training"] is None
    wrapper.reset_cuda_graph("validation")
    assert wrapper.graphs["validation"] is None and wrapper.calls["validation"] == 0


def test_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(FullCudaGraphUnavailable, match="needs a CUDA device"):
        FullCudaGraphWrapper(_forward_backward)
