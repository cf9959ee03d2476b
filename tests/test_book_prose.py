"""Prose against code, per page: a page that is mostly code reads like the code it verifies.

For every book page (a chapter `.py` in percent format) count the non-blank lines of its
markdown cells and of its code cells. The ratio prose/code is the page's figure. Pages listed in
`PAGES_AT_GOAL` must stay at or above their threshold: 0.5 for every page, 0.6 for chapter 04
(the data pipeline is mostly formats and invariants, which are told better in words). The whole
book's figure is printed beside the table.

`pytest -s tests/test_book_prose.py` shows the table; `python tests/test_book_prose.py` prints it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")  # the book extra; absent on a bare GPU box

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"

# The lowest prose/code a page may have, and the higher floor of the chapters listed.
DEFAULT_THRESHOLD = 0.5
CHAPTER_THRESHOLDS = {"04_data": 0.6}
PAGE_THRESHOLDS = {"03_checkpoint/resume.py": 0.6,   # pages held higher than their chapter
                   "03_checkpoint/saved_state.py": 0.6,
                   "07_memory/calculator.py": 0.6,
                   "07_memory/config_ledger.py": 0.6,
                   "07_memory/megatron_gap.py": 0.6}

# Pages brought to their threshold; each is held there from then on (paths under chapters/).
PAGES_AT_GOAL = {
    "00_overview/batch.py",
    "00_overview/grpo.py",
    "00_overview/loss.py",
    "00_overview/modes.py",
    "00_overview/pipeline.py",
    "00_overview/sft.py",
    "01_main_loop/assembled.py",
    "01_main_loop/host_syncs.py",
    "01_main_loop/loop.py",
    "01_main_loop/interleaved.py",
    "01_main_loop/memory_meter.py",
    "01_main_loop/microbatches.py",
    "01_main_loop/pipeline_orders.py",
    "01_main_loop/resident_flowing.py",
    "01_main_loop/run.py",
    "01_main_loop/schedule_timeline.py",
    "01_main_loop/schedules.py",
    "01_main_loop/training_log.py",
    "01_main_loop/virtual_stages.py",
    "02_optimizer/algorithms.py",
    "02_optimizer/distributed.py",
    "02_optimizer/factory.py",
    "02_optimizer/layer_wise.py",
    "02_optimizer/mixed_precision.py",
    "02_optimizer/muon.py",
    "02_optimizer/offload.py",
    "02_optimizer/scheduler.py",
    "02_optimizer/training.py",
    "02_optimizer/zero1.py",
    "02_optimizer/zero_fsdp.py",
    "03_checkpoint/async_save.py",
    "03_checkpoint/formats.py",
    "03_checkpoint/legacy.py",
    "03_checkpoint/resharding.py",
    "03_checkpoint/convert.py",
    "03_checkpoint/resume.py",
    "03_checkpoint/saved_state.py",
    "03_checkpoint/sharded_keys.py",
    "03_checkpoint/staged_copy.py",
    "03_checkpoint/torch_dist.py",
    "04_data/blended.py",
    "04_data/distribute.py",
    "04_data/gpt_dataset.py",
    "04_data/gpt_indices.py",
    "04_data/index_tables.py",
    "04_data/indexed.py",
    "04_data/pipeline.py",
    "04_data/preprocess.py",
    "04_data/samplers.py",
    "04_data/sft.py",
    "05_buffers/distributed_data_parallel.py",
    "05_buffers/bucket_group.py",
    "05_buffers/naive_ddp.py",
    "05_buffers/overlap_timeline.py",
    "05_buffers/param_and_grad_buffer.py",
    "05_buffers/finalize_model_grads.py",
    "model/config.py",
    "model/gpt.py",
    "model/hf.py",
    "model/layers.py",
    "model/transformer_layer.py",
    "parallel/context_parallel.py",
    "parallel/grid.py",
    "parallel/rng.py",
    "parallel/tensor_parallel.py",
    "parallel/vocab_parallel.py",
    "kernels/roofline.py", "kernels/rmsnorm.py", "kernels/swiglu.py", "kernels/cross_entropy.py", "kernels/flash_attention.py", "kernels/fused_adamw.py", "kernels/inductor.py",
    "06_recompute_offload/activation_memory.py", "06_recompute_offload/checkpoint.py",
    "06_recompute_offload/offload.py", "06_recompute_offload/recompute.py",
    "08_reliability/fault_injection.py", "08_reliability/fault_tolerance.py",
    "08_reliability/full_cuda_graph.py", "08_reliability/long_run.py",
    "08_reliability/observability.py", "08_reliability/rerun_diagnoses.py",
    "08_reliability/rerun_state_machine.py",
    "08_reliability/restarts.py", "08_reliability/result_checks.py", "08_reliability/timers.py",
    "08_reliability/trace.py", "08_reliability/loop_hooks.py",
    "07_memory/activations.py",
    "07_memory/calculator.py",
    "07_memory/config_ledger.py",
    "07_memory/ledger.py",
    "07_memory/measured.py",
    "07_memory/megatron_gap.py",
    "07_memory/megatron_model.py",
    "07_memory/peak.py",
    "07_memory/states.py",
    "07_memory/step_compute.py",
    "07_memory/step_offload.py",
    "07_memory/step_overlap.py",
    "07_memory/step_time.py",
    "model/generate.py",
    "parallel/pipeline_p2p.py",
}


def _pages() -> list[Path]:
    return sorted(p for p in CHAPTERS.glob("*/*.py") if not p.name.startswith("_"))


def count(page: Path) -> tuple[int, int]:
    """(prose, code): non-blank lines of the page's markdown cells and of its code cells."""
    prose = code = 0
    for cell in jupytext.read(page).cells:
        lines = sum(1 for line in cell.source.splitlines() if line.strip())
        if cell.cell_type == "markdown":
            prose += lines
        elif cell.cell_type == "code":
            code += lines
    return prose, code


def threshold(name: str) -> float:
    if name in PAGE_THRESHOLDS:
        return PAGE_THRESHOLDS[name]
    return CHAPTER_THRESHOLDS.get(name.split("/")[0], DEFAULT_THRESHOLD)


def table() -> tuple[list[tuple[str, int, int]], str]:
    """Every page's counts, and the table as text (lowest ratio first, the whole book last)."""
    rows = [(str(p.relative_to(CHAPTERS)), *count(p)) for p in _pages()]
    ratio = lambda prose, code: prose / code if code else float("inf")  # noqa: E731
    lines = [f"{'page':48s} {'prose':>6s} {'code':>6s} {'ratio':>6s} {'floor':>6s}"]
    for name, prose, code in sorted(rows, key=lambda r: ratio(r[1], r[2])):
        goal = f"{threshold(name):.2f}" if name in PAGES_AT_GOAL else ""
        lines.append(f"{name:48s} {prose:6d} {code:6d} {ratio(prose, code):6.2f} {goal:>6s}")
    prose, code = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines.append(f"{'whole book (' + str(len(rows)) + ' pages)':48s} {prose:6d} {code:6d} "
                 f"{ratio(prose, code):6.2f}")
    return rows, "\n".join(lines)


def test_pages_at_goal_exist():
    missing = sorted(name for name in PAGES_AT_GOAL if not (CHAPTERS / name).exists())
    assert not missing, f"PAGES_AT_GOAL names pages that do not exist: {missing}"


def test_prose_per_page_meets_its_threshold():
    rows, text = table()
    print("\n" + text)
    low = [f"{name}: {prose}/{code} = {prose / code:.2f} < {threshold(name):.2f}"
           for name, prose, code in rows
           if name in PAGES_AT_GOAL and code and prose / code < threshold(name)]
    assert not low, "pages below their prose/code threshold:\n" + "\n".join(low)


# A code cell a reader takes in at once: at most 40 lines. A long definition is cut at its seams
# (a schedule's warm-up, steady state and cool-down as helpers; a config's field groups as a
# base class), with prose between. An exception would be named here, (page, its first
# definition line), with its reason; there is none.
CELL_LINES_MAX = 40
LONG_CELLS_LEFT: set[tuple[str, str]] = set()



def long_code_cells() -> set[tuple[str, str]]:
    """(page, the cell's first definition line) of every code cell over CELL_LINES_MAX lines."""
    found = set()
    for page in _pages():
        for cell in jupytext.read(page).cells:
            lines = cell.source.splitlines()
            if cell.cell_type == "code" and len(lines) > CELL_LINES_MAX:
                head = next((line for line in lines if line.startswith(("def ", "class "))), "")
                named = next((k for _, k in LONG_CELLS_LEFT if head.startswith(k)), head)
                found.add((str(page.relative_to(CHAPTERS)), named))
    return found


def test_code_cells_are_at_most_40_lines():
    found = long_code_cells()
    new = sorted(found - LONG_CELLS_LEFT)
    assert not new, f"code cells over {CELL_LINES_MAX} lines (split them, prose between): {new}"
    gone = sorted(LONG_CELLS_LEFT - found)
    assert not gone, f"LONG_CELLS_LEFT names cells now within {CELL_LINES_MAX} lines: {gone}"


# A page a reader finishes in one sitting: one lesson, at most ~2,500 words of prose, counted
# with every folded answer, hint and "Megatron detail" box open (a reader who opens them reads
# them). A longer page is split where its mechanism has a seam (07's step time became four
# pages, 01's schedules two), or tightened where it is one lesson a little over.
PAGE_WORDS_MAX = 2500


def prose_words(page: Path) -> tuple[int, int]:
    """(words in view, words with every folded box open) of a page's markdown cells."""
    markdown = "\n".join(c.source for c in jupytext.read(page).cells if c.cell_type == "markdown")
    folded = re.sub(r"<details.*?</details>", " ", markdown, flags=re.S)
    return len(folded.split()), len(markdown.split())


def test_pages_are_at_most_2500_words():
    over = []
    for page in _pages():
        shown, opened = prose_words(page)
        if opened > PAGE_WORDS_MAX:
            over.append(f"{page.relative_to(CHAPTERS)}: {shown} words in view, {opened} open")
    assert not over, f"pages over {PAGE_WORDS_MAX} words (split them where the mechanism has a seam): {over}"


def test_the_counter_counts_markdown_against_code(tmp_path):
    page = tmp_path / "page.py"
    page.write_text("# %% [markdown]\n# # Title\n#\n# Two lines.\n\n"
                    "# %%\nx = 1\n\ny = 2\nz = 3\n\n"
                    "# %% [markdown]\n# One more.\n")
    assert count(page) == (3, 3)


if __name__ == "__main__":
    sys.stdout.write(table()[1] + "\n")
