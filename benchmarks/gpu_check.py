"""The report of scripts/gpu_check.sh: one JSON per device, rewritten after every step.

    python3 benchmarks/gpu_check.py start --dest DIR --command N --plan STEPS [--dry]
    python3 benchmarks/gpu_check.py record --json PATH --step NAME --status STATUS ...
    python3 benchmarks/gpu_check.py trainer --variant V --rc RC --jsonl PATH --out F -- ARGV

`start` names the JSON after the device (`h200.json`) and lists the command's steps as
pending, so a command cut off by its lease still leaves a report that says how far it got.
`record` folds one step's outcome and its measurements (the few numbers the book's pages
show, taken from the step's own output) into the JSON, and writes a short text beside it
(`gpu_check.md`). `trainer` reads a trainer run's JSONL: the last logged interval's
tokens/s, MFU and ms/iteration, the allocator's peak against chapter 07's ledger, and
chapter 07's step-time model for the same layout; a run that stopped short of the asked
iterations is reported as such, never as a result.

The JSON's shape is what `chapters/_gpu_results.py` (`tinytron._gpu_results`) renders on the
pages: {"device", "torch", "triton", "cuda", "date", "dry_run", "steps": {name: {"status",
"seconds", "limit", "date", "command", "headline", "data"}}}. Only `start` and `trainer`
import torch; `record` runs on the standard library (it runs after every step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gpu"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())


def device_slug(name: str) -> str:
    """A file name for a device: its model number when it has one ('NVIDIA H200' -> 'h200')."""
    low = name.lower()
    model = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", low)
    return model.group(1) if model else (re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "gpu")


def environment(dry: bool) -> dict:
    """Device, versions and date: the header every page's table cites."""
    import platform

    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available() and not dry
    name = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.machine()}), dry run"
    return {"schema": 1, "device": name, "slug": device_slug(name) if cuda else "cpu-dry-run",
            "device_count": torch.cuda.device_count() if cuda else 0,
            "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "dry_run": dry, "date": now()}


def start(args) -> None:
    """Write the JSON with this command's steps pending; print its path."""
    env = environment(args.dry)
    path = Path(args.dest) / f"{env['slug']}.json"
    report = {"steps": {}}
    # a run's second command keeps the first one's results (copied back beside the book's)
    for base in (path,) if args.dry else (path, RESULTS / path.name):
        if base.is_file():
            report = json.loads(base.read_text())
            break
    report.update(env)
    for item in args.plan.split(";"):
        name, limit, title = item.split(":", 2)
        report["steps"][name] = {"command": args.command, "title": title, "status": "pending",
                                 "limit": int(limit), "date": env["date"]}
    write(path, report)
    print(path)


def write(path: Path, report: dict) -> None:
    """The JSON and, beside it, gpu_check.md: rewritten whole (atomic renames)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)
    md = path.parent / "gpu_check.md"
    md.with_suffix(".md.tmp").write_text(summary_text(report))
    os.replace(md.with_suffix(".md.tmp"), md)


def summary_text(report: dict) -> str:
    """A short text: the device and one line per step (status, time, headline numbers)."""
    lines = [f"# tinytron GPU check: {report['device']}", "",
             f"torch {report['torch']}, Triton {report['triton']}, CUDA {report['cuda']}, "
             f"Python {report['python']}; {report['device_count']} device(s); {report['date']}"]
    if report.get("dry_run"):
        lines += ["", "**Dry run on CPU**: the steps' plumbing, no number here is a GPU's."]
    lines += ["", "| command | step | status | seconds (limit) | headline |",
              "|---|---|---|---|---|"]
    for name, s in report["steps"].items():
        secs = f"{s['seconds']:.0f}" if "seconds" in s else ""
        lines.append(f"| {s['command']} | {name}: {s['title']} | {s['status']} | {secs} "
                     f"({s['limit']}) | {s.get('headline', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def record(args) -> None:
    """Fold one step's outcome (and its measurements, when it has any) into the JSON."""
    path = Path(args.json)
    report = json.loads(path.read_text())
    step = report["steps"].setdefault(args.step, {"command": 0, "title": args.step,
                                                  "limit": args.limit})
    step.update(status=args.status, seconds=args.seconds, limit=args.limit, date=now())
    kind = re.sub(r"_(torch|compile|triton)$", "", args.step)
    data, headline = {}, ""
    try:
        data, headline = EXTRACT.get(kind, _extract_none)(args.raw, args.log)
    except Exception as e:  # noqa: BLE001 - a report: a step's odd output must not lose it
        headline = f"its output could not be read ({type(e).__name__}: {e})"
    if args.status != "ok" and args.log and os.path.isfile(args.log):
        tail = [x for x in Path(args.log).read_text(errors="replace").splitlines() if x.strip()]
        step["log_tail"] = tail[-6:]
        headline = headline or (tail[-1][:200] if tail else "")
    step.update(data=data, headline=headline)
    write(path, report)


# -- what each step measured: (data for the pages, a headline for the text) --------------------
def _load(raw: str | None) -> dict:
    return json.loads(Path(raw).read_text()) if raw and os.path.isfile(raw) else {}


def _extract_none(raw, log) -> tuple[dict, str]:
    """No measurements: the log's last line is the headline ('42 kernels', a skip's reason)."""
    text = Path(log).read_text(errors="replace") if log and os.path.isfile(log) else ""
    lines = [x for x in text.splitlines() if x.strip()]
    return {}, lines[-1][:200] if lines else ""


def _extract_trainer(raw, log) -> tuple[dict, str]:
    d = _load(raw)
    if not d.get("tokens_per_second"):
        return d, d.get("why", "")
    mfu = f"MFU {100 * d['mfu']:.1f}%" if d.get("mfu") is not None else "no MFU (peak unknown)"
    peak = (f"; peak {d['peak_allocated_bytes'] / 2**30:.1f} GiB = "
            f"{d['peak_over_ledger']:.2f} x ledger" if d.get("peak_over_ledger") else "")
    return d, (f"{d['tokens_per_second']:,.0f} tokens/s, {mfu}, "
               f"{d['ms_per_iteration']:.0f} ms/iteration{peak}")


def _pytest_counts(log) -> dict:
    """pytest's own summary line ('3 passed, 1 skipped in 4.2s'), counted per outcome."""
    text = Path(log).read_text(errors="replace") if log and os.path.isfile(log) else ""
    counts = {}
    for line in text.splitlines():
        if re.search(r"\b(passed|failed|skipped|error|errors|deselected|tests? collected)\b",
                     line) and re.search(r"\bin [\d.]+s\b", line):
            counts = {w: int(n) for n, w in re.findall(r"(\d+) (\w+)", line)}
    if m := re.search(r"^[= ]*(\d+)/\d+ tests? collected", text, re.M):  # --collect-only -m gpu
        counts = {"collected": int(m[1])}
    if not counts:  # cut off before its summary: pytest -v's line per test, counted
        for word in re.findall(r"^\S+::\S+.* (PASSED|FAILED|SKIPPED|ERROR)\b", text, re.M):
            counts[word.lower()] = counts.get(word.lower(), 0) + 1
    failed = list(dict.fromkeys(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M) + re.findall(
        r"^(\S+::\S+).* (?:FAILED|ERROR)\b", text, re.M)))
    return {"counts": counts, "failed": failed[:20]} if counts or failed else {}


def _extract_pytest(raw, log) -> tuple[dict, str]:
    d = _pytest_counts(log)
    return d, ", ".join(f"{n} {w}" for w, n in d.get("counts", {}).items())


def _extract_kernels(raw, log) -> tuple[dict, str]:
    r = _load(raw)
    if not r:
        return {}, ""
    out = {"peak_bytes_per_s_datasheet": r.get("peak_bytes_per_s_datasheet"),
           "copy_bytes_per_s_measured": r.get("copy_bytes_per_s_measured")}
    for name in ("rmsnorm", "swiglu", "cross_entropy"):
        row = r.get(name, {})
        out[name] = {impl: {"fwd_bwd_ms": v["fwd_bwd_ms"],
                            "fraction_of_peak": v.get("fraction_of_peak", {}).get("fwd_bwd")}
                     for impl in ("triton", "eager", "compile")
                     if isinstance(v := row.get(impl), dict)}
    att = r.get("attention", {})
    if att:
        out["attention"] = {"shape": att["shape"], "sdpa_backend": att["sdpa_backend"],
                            "triton_tflops": att["triton"]["TFLOP_per_s"]["fwd_bwd"],
                            "sdpa_tflops": att["sdpa"]["TFLOP_per_s"]["fwd_bwd"],
                            "triton_over_sdpa": att["triton_over_sdpa"]["fwd_bwd"]}
    if "adamw" in r:
        out["adamw"] = {impl: r["adamw"][impl]["GB_per_s"] for impl in ("triton", "eager_foreach")}
    frac = out["rmsnorm"].get("triton", {}).get("fraction_of_peak")
    head = [f"RMSNorm {frac:.0%} of HBM peak" if frac else ""]
    if "attention" in out:
        head.append(f"flash / SDPA {out['attention']['triton_over_sdpa']:.2f}")
    return out, ", ".join(h for h in head if h)


def _extract_recompute(raw, log) -> tuple[dict, str]:
    r = _load(raw)
    modes = {name: {k: m.get(k) for k in ("ratio_median", "ratio_best", "median_s", "goal",
                                          "held_bytes", "peak_bytes")}
             for name, m in r.get("modes", {}).items()}
    head = ", ".join(f"{n} x{m['ratio_median']:.2f}" for n, m in modes.items() if n != "none")
    return {"model": r.get("model"), "micro_batch": r.get("micro_batch"), "modes": modes}, head


def _extract_staging(raw, log) -> tuple[dict, str]:
    r = _load(raw)
    if not r:
        return {}, ""
    med = r["median_seconds"]
    out = {"parameters": r["parameters"], "checkpoint_bytes": r["checkpoint_bytes"],
           "ratios_of_medians": r["ratios_of_medians"],
           "median_seconds": {k: v for k, v in med.items()
                              if k.startswith(("sync", "reference", "thread_staged"))}}
    if "thread_staged_step_s" in med:
        out["thread_staged_step_extra_s"] = med["thread_staged_step_s"] - med["reference_step_s"]
    ratio = r["ratios_of_medians"].get("thread_staged_blocking_over_sync")
    return out, (f"staged blocking / sync {ratio:.3f}; whole step +"
                 f"{1e3 * out.get('thread_staged_step_extra_s', 0):.0f} ms" if ratio else "")


def _extract_cudagraph(raw, log) -> tuple[dict, str]:
    text = Path(log).read_text(errors="replace") if log and os.path.isfile(log) else ""
    m = re.search(r"eager ([\d.]+) ms, graphed ([\d.]+) ms, speed-up ([\d.]+)x", text)
    out = _pytest_counts(log)
    if m:
        out.update(eager_ms=float(m[1]), graphed_ms=float(m[2]), speedup=float(m[3]))
    counts = ", ".join(f"{n} {w}" for w, n in out.get("counts", {}).items())
    return out, f"speed-up {out['speedup']:.2f}x" if m else counts


def _extract_pipeline(raw, log) -> tuple[dict, str]:
    r = _load(raw)
    cases = {n: {"measured_step_s": c["measured_step_s"], "predicted_step_s":
                 c["predicted"]["step_s"], "step_error": c["step_error"]}
             for n, c in r.get("cases", {}).items()}
    return ({"device": r.get("device"), "cases": cases} if cases else {},
            ", ".join(f"{n} error {c['step_error']:+.0%}" for n, c in cases.items()))


EXTRACT = {"trainer": _extract_trainer, "memory": _extract_pytest, "inductor": _extract_none,
           "kernels": _extract_kernels,
           "recompute": _extract_recompute, "staging": _extract_staging,
           "cudagraph": _extract_cudagraph, "pipeline": _extract_pipeline,
           "pytest_gpu": _extract_pytest}


# -- the trainer's run, from its own JSONL ------------------------------------------------------
def trainer(args) -> int:
    """Summarize one trainer run; exit 0 only when it reached the asked iteration."""
    recs = []
    if os.path.isfile(args.jsonl):
        recs = [json.loads(x) for x in open(args.jsonl) if x.strip()]
    train = [r for r in recs if r.get("type") == "train"]
    last = train[-1]["iteration"] if train else 0
    out = {"variant": args.variant, "asked_iterations": args.iters, "iterations": last,
           "argv": args.argv}
    if args.rc in (124, 137) or last < args.iters or args.rc != 0:
        how = "timed out" if args.rc in (124, 137) else f"exit {args.rc}"
        out["why"] = f"{how}: its log's last iteration is {last} of {args.iters}"
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(out["why"])
        return 124 if args.rc in (124, 137) else (args.rc or 3)
    r = train[-1]
    mem = [t.get("memory", {}) for t in train]
    out.update({k: r.get(k) for k in ("tokens_per_second", "mfu", "tflops_per_device",
                                      "ms_per_iteration", "global_batch_size")})
    out.update(interval=[train[-2]["iteration"] + 1 if len(train) > 1 else 1, last],
               loss_first=train[0]["losses"].get("lm loss"),
               loss_last=r["losses"].get("lm loss"),
               peak_allocated_bytes=max((m.get("mem-max-allocated-bytes", 0) for m in mem),
                                        default=0) or None,
               peak_reserved_bytes=max((m.get("mem-max-reserved-bytes", 0) for m in mem),
                                       default=0) or None)
    out.update(_predictions(args.argv, r))
    if out["peak_allocated_bytes"] and out.get("ledger_total_bytes"):
        out["peak_over_ledger"] = out["peak_allocated_bytes"] / out["ledger_total_bytes"]
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(_extract_trainer(args.out, None)[1])
    return 0


def _predictions(argv: list[str], last: dict) -> dict:
    """Chapter 07's ledger (one rank) and step time for the run's own config and options."""
    import torch

    from tinytron.memory import memory_config_from, stage_ledgers
    from tinytron.memory._step_report import links_for_gpu, run_options
    from tinytron.memory.step_time import estimate_step
    from tinytron.train import resolve_config

    cfg = resolve_config([*argv, "--checkpoint.save", "none"], 1)  # read, never written
    mem = memory_config_from(cfg, 1, device="cuda")
    ledger = stage_ledgers(mem)[0]
    # appendix C's kernel law of this GPU (the H100's, named as such, on a dry run's CPU)
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H100"
    links, law = links_for_gpu(name)
    step = estimate_step(mem, links, run_options(cfg))
    return {"ledger_total_bytes": ledger.total,
            "ledger_terms": {k: v for k, v in ledger.device.items() if v},
            "predicted_step_s": step.total,
            "predicted": {"compute_s": step.compute, "bubble_s": step.bubble,
                          "optimizer_s": step.optimizer, "exposed_s": step.exposed,
                          "law": law, "peak_flops": links.peak_flops}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("start")
    p.add_argument("--dest", required=True)
    p.add_argument("--command", type=int, required=True)
    p.add_argument("--plan", required=True, help="name:limit:title;... in order")
    p.add_argument("--dry", action="store_true")
    p = sub.add_parser("record")
    p.add_argument("--json", required=True)
    p.add_argument("--step", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--limit", type=int, required=True)
    p.add_argument("--raw", default=None, help="the step's own JSON output")
    p.add_argument("--log", default=None)
    p = sub.add_parser("trainer")
    p.add_argument("--variant", required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--jsonl", required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.what == "trainer":
        args.argv = [a for a in args.argv if a != "--"]
        return trainer(args)
    (start if args.what == "start" else record)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
