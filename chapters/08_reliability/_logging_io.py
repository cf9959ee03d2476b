"""Chapter 08's console line, JSON conversion and TensorBoard reader (not a page).

The page `observability.py` keeps what is logged and under which names; what is here only
draws the console line, turns tensors into JSON values, builds a described scalar point and
reads an event file back.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

import torch


def _fmt_seconds(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressBar:
    """A console progress line: iteration, loss, LR, tokens/s, MFU, memory, ETA."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24):
        self.total, self.stream, self.width = total, stream or sys.stderr, width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def render(self, record: dict, memory: Optional[dict] = None) -> str:
        """The line for one record (no I/O)."""
        it = record["iteration"]
        done = int(self.width * min(it / max(self.total, 1), 1.0))
        parts = [f"[{'#' * done}{'-' * (self.width - done)}] {it}/{self.total}"]
        parts += [f"{k} {v:.4f}" for k, v in record.get("losses", {}).items()]
        parts.append(f"lr {record['learning_rate']:.2e}")
        parts.append(f"{record['tokens_per_second'] / 1e3:.1f}k tok/s")
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        if memory:
            # on CUDA the allocator's tensor bytes; on a CPU the process RSS (torch alone is
            # ~350 MiB of it), so the label says which one the number is
            allocated = "mem-allocated-bytes" in memory
            key, label = (("mem-allocated-bytes", "allocated") if allocated
                          else ("mem-rss-bytes", "rss"))
            parts.append(f"{label} {memory[key] / 2 ** 30:.2f} GiB")
        eta = (self.total - it) * record["ms_per_iteration"] / 1000.0
        parts.append(f"ETA {_fmt_seconds(eta)}")
        return " | ".join(parts)

    def update(self, record: dict, memory: Optional[dict] = None) -> None:
        """Draw the line for a record."""
        line = self.render(record, memory)
        end = "" if self.tty and record["iteration"] < self.total else "\n"
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()


def _jsonable(x: Any):
    """json.dumps's `default`: called only for what JSON cannot write (never a float)."""
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    return str(x)


def read_tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard log dir: {tag: [(step, value), ...]}, by its own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})  # 0 = keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def described_scalar(tag: str, value: float, description: str):
    """One scalar point as a Summary whose metadata carries `description` (TensorBoard's own
    scalar-plugin metadata; the points after it are plain `add_scalar` ones)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.scalar.metadata import create_summary_metadata

    metadata = create_summary_metadata(display_name=tag, description=description)
    return Summary(value=[Summary.Value(tag=tag, simple_value=float(value), metadata=metadata)])
