"""Plumbing of the step-time pages (07.13, 07.14): its time axis, the drawing, the saved CPU check.

Not a page. `step_timeline` lays one iteration of the model out as lanes for the drawing;
`plot_timeline` draws lanes; `trace_lanes` turns a traced iteration of the CPU check into
lanes; `cpu_case_config`, `predict_cpu_case` and `load_cpu_check` read the check that
`benchmarks/bench_step_time.py` saves under chapters/assets/.
"""

from __future__ import annotations

import json
import os

from tinytron.memory.states import MemoryConfig
from tinytron.memory.step_published import cpu_links
from tinytron.memory.step_offload import _offloaded_bytes
from tinytron.memory.step_time import (Links, StepOptions, StepTime, checkpoint_bytes,
                                       estimate_step, p2p_seconds, schedule_1f1b, stage_compute)


def step_timeline(cfg: MemoryConfig, links: Links = Links(),
                  options: StepOptions = StepOptions()) -> dict[str, list[tuple]]:
    """The lanes of one iteration of the first stage, from the model's rules."""
    tau, step = p2p_seconds(cfg, links), estimate_step(cfg, links, options)
    tp = step.item("TP").exposed / cfg.num_microbatches / 2  # on the compute stream
    stages = [(f + tp, b + tp) for f, b in stage_compute(cfg, links, options)]
    ag_wait = (step.item("DP param all-gather").per_stage if cfg.use_distributed_optimizer
               else None)
    ops = schedule_1f1b(stages, cfg.num_microbatches, tau, ag_wait)[0]
    lanes = {"compute": [(a, b, k) for k, _, a, b in ops], "DP comm": [], "PP p2p": [],
             "checkpoint": [], "offload": []}
    if cfg.use_distributed_optimizer:
        lanes["DP comm"] += [(a, b, "AG") for a, b in step.item("DP param all-gather").spans]
    last_b = ops[-1][2]
    rs = step.items[0]
    lanes["DP comm"] += [(last_b + a, last_b + b, "RS") for a, b in rs.spans]
    if len(stages) > 1:
        lanes["PP p2p"] = [(b, b + tau, "send") for k, _, _, b in ops if k == "F"]
    end = max([ops[-1][3]] + [b for a, b, _ in lanes["DP comm"]])
    lanes["compute"].append((end, end + step.optimizer, "opt"))
    if options.checkpoint != "none":
        nbytes = checkpoint_bytes(cfg)
        d2h = nbytes / links.pcie
        lanes["checkpoint"] = [(0.0, d2h, "D2H"), (d2h, d2h + nbytes / links.disk, "write")]
    if cfg.model.fine_grained_activation_offloading:
        copy = _offloaded_bytes(cfg, tuple(cfg.model.offload_modules)) / links.pcie
        per_stage = cfg.model.num_layers // cfg.pipeline_model_parallel_size
        for k, _, a, b in ops:
            step_s = (b - a) / per_stage
            lanes["offload"] += [(a + j * step_s, a + j * step_s + copy,
                                  "D2H" if k == "F" else "H2D") for j in range(per_stage)]
    return lanes


_COLORS = {"F": "tab:blue", "B": "tab:orange", "opt": "tab:green", "AG": "tab:purple",
           "RS": "tab:red", "send": "tab:brown", "D2H": "tab:gray", "write": "0.8",
           "H2D": "tab:olive", "compute": "tab:blue", "all_reduce": "tab:red",
           "all_gather": "tab:purple", "send/recv": "tab:brown"}


def plot_timeline(lanes: dict[str, list[tuple]], ax, unit: float = 1e3) -> None:
    """Draw lanes of (start, end, label) seconds as rows of bars, in ms (unit 1e3)."""
    names = [k for k, v in lanes.items() if v]
    for row, name in enumerate(names):
        for a, b, label in lanes[name]:
            ax.broken_barh([(a * unit, max((b - a) * unit, 0.3))], (-row - 0.8, 0.6),
                           color=_COLORS.get(label, "0.5"), lw=0)
    ax.set_yticks([-r - 0.5 for r in range(len(names))], labels=names, fontsize=7)
    ax.set_xlabel("ms from the step's start", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)


def cpu_case_config(argv: list[str], world_size: int = 2) -> tuple[MemoryConfig, StepOptions]:
    """The MemoryConfig and overlap switches of a trainer command line, on CPU."""
    from tinytron.config import load_config
    from tinytron.memory.calculator import memory_config_from

    train = load_config(None, argv)
    cfg = memory_config_from(train, world_size, device="cpu")
    return cfg, StepOptions(overlap_grad_reduce=train.ddp.overlap_grad_reduce,
                            overlap_param_gather=train.ddp.overlap_param_gather,
                            checkpoint="none")


def predict_cpu_case(case: dict) -> StepTime:
    """The model's step for one recorded case (argv + calibration) of the CPU check."""
    from tinytron.main_loop.training_log import num_floating_point_operations

    cfg, options = cpu_case_config(case["argv"])
    flops = num_floating_point_operations(cfg.model, cfg.micro_batch_size)
    return estimate_step(cfg, cpu_links(case["calibration"], flops), options)


def load_cpu_check(path: str | None = None) -> dict:
    """The saved CPU check (chapters/assets/step_time_cpu.json)."""
    import tinytron

    path = path or os.path.join(os.path.dirname(tinytron.__file__), "assets",
                                "step_time_cpu.json")
    with open(path) as f:
        return json.load(f)


def trace_lanes(lanes: dict) -> dict[str, list[tuple]]:
    """A traced iteration of the CPU check (ms) as plot_timeline's lanes (seconds)."""
    return {"compute": [(a / 1e3, b / 1e3, "compute") for a, b in lanes["compute"]],
            "gloo": [(c["start"] / 1e3, c["end"] / 1e3, c["name"]) for c in lanes["comm"]]}
