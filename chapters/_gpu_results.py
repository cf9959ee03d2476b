"""What the pages that make GPU claims show: a "measured on <device>" table, or why there is none.

`scripts/gpu_check.sh` writes one JSON per device under `benchmarks/results/gpu/` (its shape:
`benchmarks/gpu_check.py`). `gpu_table(page)` renders the rows one page needs from every such
file, each under its device, versions and date; a step that did not finish is shown with its
outcome ("timed out", "failed"), never as a number. With no file it says that nothing has been
measured on a GPU yet and which command measures it. Standard library only: every page may
import it.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["RESULTS_DIR", "gpu_table", "load_results"]

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "gpu"
KERNELS = {"torch": "torch", "compile": "torch + compile"}


def load_results(results_dir: str | Path | None = None) -> list[dict]:
    """Every device's results (dry runs left out), in file-name order."""
    folder = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        report = json.loads(path.read_text())
        if isinstance(report, dict) and "steps" in report and not report.get("dry_run"):
            out.append(report)
    return out


def _num(x, spec: str, scale: float = 1.0) -> str:
    return "" if x is None else format(x * scale, spec)


def _outcome(step: dict | None) -> str | None:
    """None when the step measured; else what happened to it, in words."""
    if step is None or step.get("status") == "pending":
        return "not run"
    if step["status"] != "ok":
        return f"{step['status']} (limit {step['limit']} s)"
    return None


def _trainer_rows(steps: dict, cells) -> list[str]:
    rows = []
    for variant, label in KERNELS.items():
        step = steps.get(f"trainer_{variant}")
        why = _outcome(step)
        rows.append(f"| {label} | {why} |" if why else f"| {label} | {cells(step['data'])} |")
    return rows


def _training_log(steps: dict) -> list[str]:
    def cells(d):
        return (f"{d['interval'][0]}-{d['interval'][1]} | {_num(d['tokens_per_second'], ',.0f')} "
                f"| {_num(d['mfu'], '.1%')} | {_num(d['tflops_per_device'], '.0f')} "
                f"| {_num(d['ms_per_iteration'], '.0f')}")
    return (["| kernels | iterations timed | tokens/s | MFU | TFLOP/s per GPU | ms/iteration |",
             "|---|---|---|---|---|---|"] + _trainer_rows(steps, cells))


def _measured(steps: dict) -> list[str]:
    def cells(d):
        return (f"{_num(d.get('peak_allocated_bytes'), '.2f', 2**-30)} "
                f"| {_num(d.get('ledger_total_bytes'), '.2f', 2**-30)} "
                f"| {_num(d.get('peak_over_ledger'), '.3f')} "
                f"| {_num(d.get('peak_reserved_bytes'), '.2f', 2**-30)}")
    memory = steps.get("memory")
    test = _outcome(memory) or ", ".join(f"{n} {w}" for w, n in
                                         memory.get("data", {}).get("counts", {}).items())
    return (["| kernels | peak allocated (GiB) | ledger (GiB) | peak / ledger "
             "| peak reserved (GiB) |", "|---|---|---|---|---|"] + _trainer_rows(steps, cells) +
            ["", f"The ledger against the allocator on 07.6's two CUDA cases "
                 f"(`test_ledger_against_cuda_allocator`): {test}."])


def _step_time(steps: dict) -> list[str]:
    def cells(d):
        p = d["predicted"]
        return (f"{_num(d['ms_per_iteration'], '.0f')} | {_num(d['predicted_step_s'], '.0f', 1e3)} "
                f"(compute {_num(p['compute_s'], '.0f', 1e3)}, {p.get('law', 'kernel law')}) "
                f"| {_num(d['predicted_step_s'] * 1e3 / d['ms_per_iteration'] - 1, '+.0%')}")
    rows = (["| one GPU, kernels | measured ms/iteration | predicted ms | error |",
             "|---|---|---|---|"] + _trainer_rows(steps, cells))
    pipe = steps.get("pipeline")
    if pipe and pipe.get("status") == "ok" and pipe.get("data", {}).get("cases"):
        rows += ["", "| traced NCCL run | measured step (ms) | predicted (ms) | error |",
                 "|---|---|---|---|"]
        rows += [f"| {n} | {c['measured_step_s'] * 1e3:.1f} | {c['predicted_step_s'] * 1e3:.1f} "
                 f"| {c['step_error']:+.1%} |" for n, c in pipe["data"]["cases"].items()]
    elif pipe:
        rows += ["", f"Traced 2-GPU run: {pipe.get('headline') or _outcome(pipe)}."]
    return rows


def _kernels(steps: dict) -> list[str]:
    step = steps.get("kernels")
    if why := _outcome(step):
        return [f"Kernels: {why}."]
    d = step["data"]
    rows = ["| kernel (forward + backward) | Triton | eager | torch.compile |", "|---|---|---|---|"]
    for name in ("rmsnorm", "swiglu", "cross_entropy"):
        impls = d.get(name, {})
        rows.append(f"| {name}: fraction of HBM peak | " + " | ".join(
            _num(impls.get(i, {}).get("fraction_of_peak"), ".0%")
            for i in ("triton", "eager", "compile")) + " |")
    if att := d.get("attention"):
        rows.append(f"| attention {att['shape']}: TFLOP/s | {att['triton_tflops']:.0f} "
                    f"| SDPA {att['sdpa_backend']}: {att['sdpa_tflops']:.0f} | |")
        rows += ["", f"Flash attention / SDPA: {att['triton_over_sdpa']:.2f}."]
    return rows


def _recompute(steps: dict) -> list[str]:
    step = steps.get("recompute")
    if why := _outcome(step):
        return [f"Recompute: {why}."]
    rows = ["| mode | step time / none (median) | goal | peak activations (MiB) |",
            "|---|---|---|---|"]
    for name, m in step["data"]["modes"].items():
        rows.append(f"| {name} | {_num(m['ratio_median'], '.3f')} | {_num(m.get('goal'), '.2f')} "
                    f"| {_num(m.get('peak_bytes'), '.1f', 2**-20)} |")
    return rows + ["", f"Model: {step['data'].get('model')}."]


def _async_save(steps: dict) -> list[str]:
    step = steps.get("staging")
    if why := _outcome(step):
        return [f"Staged copy: {why}."]
    d, rows = step["data"], ["| save | training blocked (s) | / sync save | whole step / no save |",
                             "|---|---|---|---|"]
    med, ratios = d["median_seconds"], d["ratios_of_medians"]
    rows.append(f"| sync | {_num(med.get('sync_s'), '.3f')} | 1 "
                f"| {_num(ratios.get('sync_step_over_reference'), '.2f')} |")
    rows.append(f"| thread, staged | {_num(med.get('thread_staged_blocking_s'), '.3f')} "
                f"| {_num(ratios.get('thread_staged_blocking_over_sync'), '.3f')} "
                f"| {_num(ratios.get('thread_staged_step_over_reference'), '.2f')} |")
    return rows + ["", f"{d['parameters'] / 1e6:.0f}M parameters, "
                       f"{d['checkpoint_bytes'] / 1e9:.2f} GB per checkpoint."]


PAGES = {"training_log": (1, _training_log), "measured": (1, _measured),
         "step_time": (1, _step_time), "kernels": (2, _kernels),
         "recompute": (2, _recompute), "async_save": (2, _async_save)}


def gpu_table(page: str, results_dir: str | Path | None = None) -> str:
    """The page's "measured on <device>" tables, one per device, or a line saying there is none."""
    if page not in PAGES:
        raise ValueError(f"page {page!r} has no GPU table (known: {', '.join(PAGES)})")
    command, rows_of = PAGES[page]
    results = load_results(results_dir)
    if not results:
        return (f"Not yet measured on a GPU: run `bash scripts/gpu_check.sh {command}` on a CUDA "
                f"machine and commit the `benchmarks/results/gpu/<device>.json` it writes.")
    parts = []
    for r in results:
        parts.append(f"Measured on {r['device']} (torch {r['torch']}, Triton {r['triton']}, "
                     f"CUDA {r['cuda']}; {r['date']}) by `bash scripts/gpu_check.sh {command}`:")
        parts.append("\n".join(rows_of(r["steps"])))
    return "\n\n".join(parts)
