"""Appendix A's tracker as generator objects, and the full-iteration CUDA graph that registers them.

On CPU: the tracker draws bit for bit what the state-swapping tracker drew (an inline copy of
that implementation is the reference), its states save and load in the old format, and the
trainer refuses `[training] cuda_graph_impl = "full_iteration"` in one line. On a GPU: an
iteration with dropout captured under the wrapper draws new masks at each replay, the same masks
and losses an eager run draws from the same seeds, and the trainer's graphed run matches its
eager run.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.test_reliability_gpu import MBS, SEQ, _batches
from tinytron.parallel import ParallelGrid
from tinytron.parallel.rng import (DATA_PARALLEL_RNG, EXPERT_PARALLEL_RNG, MODEL_PARALLEL_RNG,
                                   RNGStatesTracker, model_parallel_seed)

ROOT = Path(__file__).resolve().parents[1]


class _StateSwappingTracker:
    """The tracker as it was: named state tensors swapped in with get/set_rng_state (CPU)."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}
        self.active = None

    def add(self, name, seed):
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    def get_states(self):
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states):
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name):
        original, outer = torch.get_rng_state(), self.active
        if outer is not None:
            self.states[outer] = original
        torch.set_rng_state(self.states[name])
        self.active = name
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            self.active = outer
            torch.set_rng_state(self.states[outer] if outer is not None else original)


def _script(tracker, ops: list) -> list[torch.Tensor]:
    """Run one scripted sequence of forks, draws and rewinds; every draw, in order."""
    out, saved = [], None

    def draw(kind):
        if kind == "dropout":
            out.append(F.dropout(torch.ones(37), p=0.3, training=True))
        elif kind == "normal":   # odd counts leave a cached normal behind
            out.append(torch.randn(3))
        else:
            out.append(torch.rand(5))

    def run(ops, depth):
        nonlocal saved
        for op in ops:
            if op[0] == "draw":
                draw(op[1])
            elif op[0] == "save":
                saved = tracker.get_states()
            elif op[0] == "restore" and saved is not None:
                tracker.set_states(saved)
            elif op[0] == "fork":
                with tracker.fork(op[1]):
                    run(op[2], depth + 1)
    run(ops, 0)
    out.append(torch.get_rng_state().float())   # where the default stream ended
    return out


def _random_ops(rng: random.Random, names: list[str], depth: int = 0, n: int = 12) -> list:
    ops = []
    for _ in range(n):
        r = rng.random()
        if r < 0.45:
            ops.append(("draw", rng.choice(["dropout", "normal", "uniform"])))
        elif r < 0.55:
            ops.append(("save",))
        elif r < 0.65:
            ops.append(("restore",))
        elif depth < 3:
            ops.append(("fork", rng.choice(names), _random_ops(rng, names, depth + 1, n // 2)))
    return ops


@pytest.mark.parametrize("case", range(20))
def test_forks_draw_bitwise_what_the_state_swapping_tracker_drew(case):
    rng = random.Random(case)
    names = [MODEL_PARALLEL_RNG, DATA_PARALLEL_RNG, EXPERT_PARALLEL_RNG]
    seeds = rng.sample(range(1, 10_000), 3)
    ops = _random_ops(rng, names)
    results = []
    for tracker in (_StateSwappingTracker(), RNGStatesTracker("cpu")):
        torch.manual_seed(case)
        for name, seed in zip(names, seeds):
            tracker.add(name, seed)
        results.append((_script(tracker, ops), tracker.get_states()))
    (old, old_states), (new, new_states) = results
    assert len(old) == len(new) > 1
    assert all(torch.equal(a, b) for a, b in zip(old, new)), ops
    assert old_states.keys() == new_states.keys()
    assert all(torch.equal(old_states[k], new_states[k]) for k in old_states)


def test_megatron_seeds_give_the_states_seeding_the_default_generator_gave():
    for tp_rank in range(4):
        tracker = model_parallel_seed(1234, ParallelGrid.single(), RNGStatesTracker("cpu"),
                                      tp_rank=tp_rank)
        old = _StateSwappingTracker()
        for name, seed in ((DATA_PARALLEL_RNG, 1234), (MODEL_PARALLEL_RNG, 1234 + 2718 + tp_rank),
                           (EXPERT_PARALLEL_RNG, 1234 + 1024 + tp_rank)):
            old.add(name, seed)
        new = tracker.get_states()
        assert list(new) == list(old.states)
        assert all(torch.equal(new[k], old.states[k]) for k in new), tp_rank


def test_streams_are_generators_that_set_states_rewinds_in_place():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 5)
    tracker.add("b", 6)
    gens = tracker.generators()
    assert all(isinstance(g, torch.Generator) for g in gens.values())
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(4)
    tracker.set_states(saved)
    assert tracker.generators()["a"] is gens["a"]           # the same object, rewound
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), first)
    tracker.set_states({"a": saved["a"], "c": saved["b"]})  # b dropped, c added
    assert set(tracker.generators()) == {"a", "c"} and tracker.generators()["a"] is gens["a"]
    with tracker.fork("c"):
        assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(6)))
    assert not tracker.graph_safe


def test_tracker_states_in_a_checkpoint_round_trip_and_old_files_load(tmp_path):
    from tinytron.checkpoint.saved_state import get_rng_state, set_rng_state

    names = [(DATA_PARALLEL_RNG, 11), (MODEL_PARALLEL_RNG, 12)]
    old = _StateSwappingTracker()
    for name, seed in names:
        old.add(name, seed)
    with old.fork(MODEL_PARALLEL_RNG):
        torch.rand(7)
    torch.save({"rng_tracker_states": old.get_states()}, tmp_path / "old.pt")  # the old format

    loaded = torch.load(tmp_path / "old.pt", weights_only=True)["rng_tracker_states"]
    tracker = RNGStatesTracker("cpu")
    for name, seed in names:
        tracker.add(name, seed)
    tracker.set_states(loaded)
    with tracker.fork(MODEL_PARALLEL_RNG), old.fork(MODEL_PARALLEL_RNG):
        pass   # both forks leave their stream where it was
    with old.fork(MODEL_PARALLEL_RNG):
        want = torch.rand(6)
    with tracker.fork(MODEL_PARALLEL_RNG):
        assert torch.equal(torch.rand(6), want)

    state = get_rng_state(tracker)                        # chapter 03's record, saved and read
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8
               for v in state["rng_tracker_states"].values())
    torch.save(state, tmp_path / "new.pt")
    with tracker.fork(MODEL_PARALLEL_RNG):
        want = torch.rand(5)
    set_rng_state(torch.load(tmp_path / "new.pt", weights_only=True), tracker)
    with tracker.fork(MODEL_PARALLEL_RNG):
        assert torch.equal(torch.rand(5), want)


# -- the trainer's switch -----------------------------------------------------------------------
def _train(*args: str, tmp_path) -> subprocess.CompletedProcess:
    argv = ["--config", "configs/tiny.toml", "--checkpoint.save", str(tmp_path / "run"), *args]
    return subprocess.run([sys.executable, "-m", "tinytron.train", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_trainer_refuses_the_graph_on_cpu_in_one_line_before_starting(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _train("--training.cuda_graph_impl", "full_iteration", tmp_path=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert len(lines) == 1 and "training.cuda_graph_impl" in lines[0], lines
    assert "CUDA" in lines[0] and "Traceback" not in proc.stderr
    assert "tinytron.train: world" not in proc.stdout        # no world was started
    assert not (tmp_path / "run").exists()                   # nothing written


def test_trainer_refuses_an_unknown_graph_implementation(tmp_path):
    proc = _train("--training.cuda_graph_impl", "local", tmp_path=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.stdout, proc.stderr)
    assert "training.cuda_graph_impl" in lines[0] and "'local'" in lines[0], lines


GRAPH = ["--training.cuda_graph_impl", "full_iteration",
         "--reliability.check_for_nan_in_loss_and_grad", "false"]


@pytest.mark.parametrize("override, key", [
    (["--model.recompute_granularity", "full", "--model.recompute_method", "uniform",
      "--model.recompute_num_layers", "1"], "model.recompute_granularity"),
    (["--reliability.check_for_spiky_loss", "true"], "reliability.check_for_spiky_loss"),
    (["--reliability.check_for_large_grads", "true"], "reliability.check_for_large_grads"),
    (["--reliability.check_for_nan_in_loss_and_grad", "true"],
     "reliability.check_for_nan_in_loss_and_grad"),
    (["--reliability.faults", "nan@3"], "reliability.faults"),
    (["--training.global_batch_size", "null", "--training.step_batch_size_schedule", "0:16 1M:32"],
     "training.step_batch_size_schedule"),
    (["--training.cuda_graph_warmup_steps", "0"], "training.cuda_graph_warmup_steps"),
])
def test_what_a_captured_iteration_cannot_hold_is_refused_by_name(override, key):
    """With a CUDA device given as present, each setting a capture cannot hold is named."""
    from tinytron.config import ConfigError, load_config
    from tinytron.train import check_cuda_graph

    tiny = str(ROOT / "configs/tiny.toml")
    check_cuda_graph(load_config(tiny, GRAPH).resolve(1), cuda_available=True)  # this one runs
    with pytest.raises(ConfigError) as e:
        check_cuda_graph(load_config(tiny, GRAPH + override).resolve(1), cuda_available=True)
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)
    check_cuda_graph(load_config(tiny, override).resolve(1), cuda_available=True)  # no graph: fine


# -- on a GPU -----------------------------------------------------------------------------------
@pytest.fixture
def fresh_graphs():
    from tinytron.reliability.full_cuda_graph import FullCudaGraphWrapper

    FullCudaGraphWrapper.reset_cuda_graph()
    yield FullCudaGraphWrapper
    FullCudaGraphWrapper.reset_cuda_graph()


MICRO, ITERS, WARMUP = 2, 6, 2  # [MBS, SEQ] batches: test_reliability_gpu._batches


def _fb_with_masks(forward_step_func=None, data_iterator=None, model=None, num_microbatches=1,
                   forward_only=False, tracker=None, **_):
    """Gradient accumulation with dropout in the model, plus one mask drawn from each stream."""
    losses = []
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        loss = model[0](batch["tokens"], labels=batch["labels"]).float().mean()
        if not forward_only:
            (loss / num_microbatches).backward()
        losses.append(loss.detach())
    with tracker.fork():                      # the model-parallel stream
        tp_mask = F.dropout(torch.ones(512, device="cuda"), 0.5, training=True) != 0
    dp_mask = F.dropout(torch.ones(512, device="cuda"), 0.5, training=True) != 0   # default
    return torch.stack(losses), tp_mask, dp_mask


def _run_dropout(graphed: bool):
    from functools import partial

    from tinytron.model import GPTModel, tiny_config
    from tinytron.reliability.full_cuda_graph import FullCudaGraphWrapper

    grid = ParallelGrid.single()
    tracker = RNGStatesTracker("cuda")
    torch.manual_seed(0)
    model = GPTModel(tiny_config(dropout=0.2), grid, device="cuda", rng_tracker=tracker)
    model_parallel_seed(1234, grid, tracker)  # seeds the CUDA default generator and the streams
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fb = partial(_fb_with_masks, tracker=tracker)
    if graphed:
        fb = FullCudaGraphWrapper(fb, cuda_graph_warmup_steps=WARMUP, rng_tracker=tracker)
    out = []
    for step in _batches(ITERS, MICRO):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()       # in place: the graph keeps writing into these tensors
        data = iter(step) if graphed else iter([{k: v.cuda() for k, v in b.items()} for b in step])
        losses, tp_mask, dp_mask = fb(data_iterator=data, model=[model], num_microbatches=MICRO,
                                      forward_only=False)
        out.append((losses.cpu(), tp_mask.cpu(), dp_mask.cpu()))   # consume before the next call
        opt.step()
    torch.cuda.synchronize()
    return out, tracker.get_states(), torch.cuda.get_rng_state(), fb


class _ReplayedResults:
    """The wrapper's result contract on CPU: `warmup` eager calls return fresh reports; the
    capture's reports are then returned by every later call, overwritten in place."""

    def __init__(self, forward_backward_func, warmup: int):
        self.fn, self.warmup, self.calls, self.static = forward_backward_func, warmup, 0, None

    def __call__(self, **kwargs):
        reports = self.fn(**kwargs)
        self.calls += 1
        if self.calls <= self.warmup:
            return reports
        if self.static is None:       # the capture's outputs: what every replay hands back
            self.static = reports
        else:                         # a replay writes its values into those same tensors
            for old, new in zip(self.static, reports):
                for key in old:
                    old[key].copy_(new[key])
        return self.static


def test_evaluation_through_replayed_results_equals_the_eager_evaluation():
    """Validation under the graph: each replay's losses count once, not the last one N times."""
    from tests.main_loop_workers import CFG, FORWARD_STEP, MBS as EVAL_MBS
    from tinytron.main_loop._loop_workers import SyntheticTokens
    from tinytron.main_loop.loop import build_schedule_config, evaluate
    from tinytron.main_loop.schedules import get_forward_backward_func
    from tinytron.model import build_stage_models

    grid, eval_iters, micro = ParallelGrid.single(), 4, 2
    torch.manual_seed(0)
    model = build_stage_models(CFG, grid)
    valid = SyntheticTokens(64, CFG.seq_length, CFG.vocab_size, 1235)
    batches = [{k: torch.stack([valid[i + j][k] for j in range(EVAL_MBS)]) for k in valid[0]}
               for i in range(0, eval_iters * micro * EVAL_MBS, EVAL_MBS)]

    def run(forward_backward_func, data=batches, iters=eval_iters):
        return evaluate(FORWARD_STEP, iter(data), model, forward_backward_func,
                        num_microbatches=micro, micro_batch_size=EVAL_MBS,
                        seq_length=CFG.seq_length, eval_iters=iters, grid=grid,
                        config=build_schedule_config(model, None, grid))["lm loss"]

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eager = run(get_forward_backward_func(1))
        replayed = run(_ReplayedResults(get_forward_backward_func(1), warmup=1))
        last_batch = run(get_forward_backward_func(1), batches[-micro:], 1)
    finally:
        torch.set_num_threads(old)
    assert replayed == eager               # the same numbers, added in the same order
    assert last_batch != eager             # what keeping references would have averaged


@pytest.mark.gpu
def test_replays_draw_new_dropout_masks_equal_to_the_eager_run(fresh_graphs):
    eager, eager_states, eager_default, _ = _run_dropout(graphed=False)
    graphed, graph_states, graph_default, wrapper = _run_dropout(graphed=True)
    assert wrapper.graphs["training"] is not None and wrapper.calls["training"] == ITERS
    for i in range(ITERS):
        assert torch.equal(graphed[i][1], eager[i][1]), f"model-parallel mask, iteration {i}"
        assert torch.equal(graphed[i][2], eager[i][2]), f"default-stream mask, iteration {i}"
    for i in range(WARMUP, ITERS - 1):        # replays: each draws new masks on both streams
        assert not torch.equal(graphed[i][1], graphed[i + 1][1]), i
        assert not torch.equal(graphed[i][2], graphed[i + 1][2]), i
    assert not torch.equal(graphed[-1][1], graphed[-1][2])
    torch.testing.assert_close(torch.stack([o[0] for o in graphed]),
                               torch.stack([o[0] for o in eager]), rtol=1e-5, atol=0)
    # the replays advanced every registered stream exactly as the eager draws did
    assert all(torch.equal(graph_states[k], eager_states[k]) for k in eager_states)
    assert torch.equal(graph_default, eager_default)


@pytest.mark.gpu
def test_a_second_wrapper_replays_the_class_graph_and_refuses_another_model(fresh_graphs):
    from tinytron.model import GPTModel, tiny_config

    _, _, _, first = _run_dropout(graphed=True)
    graph = first.graphs["training"]
    second = fresh_graphs(_fb_with_masks, cuda_graph_warmup_steps=WARMUP)
    assert second.graphs["training"] is graph and second.calls["training"] == ITERS
    other = GPTModel(tiny_config(dropout=0.2), ParallelGrid.single(), device="cuda",
                     rng_tracker=RNGStatesTracker("cuda"))
    t = torch.randint(0, 512, (MBS, SEQ))
    batches = iter([{"tokens": t, "labels": t}] * MICRO)
    with pytest.raises(RuntimeError, match="reset_cuda_graph"):
        second(data_iterator=batches, model=[other], num_microbatches=MICRO, forward_only=False)


@pytest.mark.gpu
def test_trainer_graphed_run_matches_its_eager_run(tmp_path):
    """The user's command with the graph: training and validation graphs, dropout on."""
    from tests.train_workers import read_losses
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus

    data = preprocess(["--input", *stdlib_corpus(40), "--output-prefix", str(tmp_path / "corpus"),
                       "--workers", "1", "--no-progress", "--append-eod"])
    common = ["--data.data_path", data, "--training.device", "cuda", "--training.train_iters", "8",
              "--training.eval_interval", "4", "--training.eval_iters", "4",
              "--training.log_interval", "1", "--scheduler.lr_warmup_iters", "2",
              "--model.dropout", "0.1", "--reliability.check_for_nan_in_loss_and_grad", "false",
              "--logging.progress_bar", "false"]
    losses, valid = {}, {}
    for impl in ("none", "full_iteration"):
        proc = _train(*common, "--training.cuda_graph_impl", impl, tmp_path=tmp_path / impl)
        assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
        jsonl = tmp_path / impl / "run" / "log.jsonl"
        losses[impl] = read_losses(str(jsonl))
        valid[impl] = {r["iteration"]: r["validation"]["lm loss"]
                       for r in map(json.loads, jsonl.read_text().splitlines()) if "validation" in r}
    assert sorted(losses["none"]) == list(range(1, 9)) == sorted(losses["full_iteration"])
    for it, ref in losses["none"].items():
        assert abs(losses["full_iteration"][it] - ref) <= 1e-4 * abs(ref), (it, losses)
    assert sorted(valid["none"]) == [4, 8] == sorted(valid["full_iteration"])  # 4th call captures
    for it, ref in valid["none"].items():
        assert abs(valid["full_iteration"][it] - ref) <= 1e-4 * abs(ref), (it, valid)
