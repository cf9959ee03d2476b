"""The assembled trainer: every chapter, wired into one torchrun job.

    torchrun --nproc-per-node 2 -m tinytron.train --config configs/tiny.toml [--section.key value ...]
    tinytron-train --config configs/tiny.toml          # one process, no torchrun

What it does, in the order of chapter 01's `pretrain` (`megatron/training/training.py:1029`):
read and check the whole config before any process group exists (`tinytron.config`), join
the world (gloo on CPU, NCCL on CUDA), build the process-group grid (appendix A), the model
chunks (appendix B, with chapter 06's recompute/offload switches and appendix C's kernels as
the config says), wrap them in chapter 05's DDP, build chapter 02's optimizer and scheduler,
resume from chapter 03's checkpoint (`load_plan`, checked before the world is joined: the save
directory's latest, or the `[checkpoint] load` given, which must hold one), build chapter 04's
datasets (the standard library tokenized into a `.bin/.idx` by default; a dataset's tokenizer
sidecar must match `[tokenizer]`) and run chapter 01's loop with chapter 08's safety nets,
timers, progress bar, JSONL and TensorBoard logs. At the end it evaluates once more, draws the
loss curve and prints the commands that continue the run, export it to Hugging Face and open
the logs.

No chapter's logic lives here: this file only wires.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from tinytron.config import ConfigError, TrainConfig, load_config

__all__ = ["main", "console_main", "run", "prepare_embedded_corpus", "build_tokenizer_for", "plot_loss_curve"]

USAGE = ("usage: torchrun --nproc-per-node N -m tinytron.train --config FILE.toml "
         "[--section.key value ...]\n"
         "       WORLD_SIZE=N python -m tinytron.train --check --config FILE.toml [...]   "
         "# check only: exit 0, or 2 and one line")
EMBEDDED_CORPUS_FILES = 400  # the first 400 .py files of the standard library: ~5 MB of bytes


# -- the command line ------------------------------------------------------------------------
def _split_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--config path, the dotted overrides)."""
    config, rest = None, []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            raise SystemExit(print(_help(args[:1])) or 0)
        if arg == "--config" or arg.startswith("--config="):
            config = arg.split("=", 1)[1] if "=" in arg else (args.pop(0) if args else None)
            if config is None:
                raise ConfigError("--config needs a file")
        else:
            rest.append(arg)
    return config, rest


def _help(words: list[str]) -> str:
    """Usage, this module's summary and every config key (`--help SECTION`: that section's)."""
    from tinytron.config import SECTIONS, config_help

    picked = [w for w in words if w in SECTIONS]
    keys = config_help(picked or None)
    if picked:
        return keys
    return "\n".join([USAGE, "", __doc__.strip(), "",
                      "Every key, as --section.key VALUE (a list: a TOML list or words separated "
                      "by commas; --help SECTION shows one section):", "", keys])


def resolve_config(argv: list[str], world_size: int) -> TrainConfig:
    """The whole run's config, checked for this world size (every error a ConfigError)."""
    path, overrides = _split_argv(argv)
    cfg = load_config(path, overrides).resolve(world_size)
    _check_trainer_rules(cfg)
    load_plan(cfg, Path(path).stem if path else "run")  # the checkpoint to resume, checked
    if not cfg.never_save:  # checkpoint.save none writes nothing anywhere: nothing to check
        check_save_dir(output_dir(cfg, Path(path).stem if path else "run"))
    return cfg


def load_plan(cfg: TrainConfig, name: str = "run"):
    """Which checkpoint the run resumes (chapter 03), checked on the files, or a ConfigError.

    A `[checkpoint] load` that is given must hold a checkpoint (a root with a tracker, or one
    of its `iter_NNNNNNN` directories); only the save directory may be empty (a first run).
    The checkpoint's model config must equal `[model]`: checked here, before anything is written.
    """
    from tinytron.checkpoint import CheckpointConfig
    from tinytron.checkpoint._load_dir import (model_config_differences, plan_load,
                                               saved_model_config)

    ckpt = cfg.extra.get("checkpoint") or CheckpointConfig()
    save = None if cfg.never_save else output_dir(cfg, name)
    try:
        plan = plan_load(ckpt.load, save, ckpt.ckpt_step, ckpt.exit_on_missing_checkpoint)
        saved = saved_model_config(plan.directory) if plan.directory is not None else None
        differ = model_config_differences(saved, cfg.model)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    made_for = saved and (saved.get("max_position_embeddings") or saved.get("seq_length"))
    if made_for and cfg.model.max_position_embeddings is None and made_for > cfg.model.seq_length:
        cfg.model.max_position_embeddings = made_for  # the model's context, kept for the export
    if differ:
        raise ConfigError(f"checkpoint.load: {plan.directory} holds another model ("
                          f"{', '.join(differ)}; checkpoint vs this run's [model]): resume with "
                          "the checkpoint's [model], or train a new model into another "
                          "checkpoint.save")
    return plan


def _check_trainer_rules(cfg: TrainConfig) -> None:
    """What the trainer itself needs: data paths that exist, a vocabulary that fits, a layout it runs."""
    tok = build_tokenizer_for(cfg)
    if cfg.data.sft:
        _check_sft_data(cfg, tok)
    else:
        for key, prefix in _data_prefixes(cfg):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ConfigError(f"data.{key}: {prefix}{ext} does not exist")
        _check_data_tokenizer(cfg, tok)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                          f"tokenizer's vocabulary ({tok.vocab_size})")
    s, t = cfg.scheduler, cfg.training
    _check_kernels_device(cfg)
    if t.skip_train:  # no step is taken: the learning rate is not read (arguments.py:1226-1227)
        return check_cuda_graph(cfg, torch.cuda.is_available())
    if cfg.optimizer.lr is None:
        raise ConfigError("optimizer.lr is required")
    decay = s.lr_decay_iters or t.train_iters
    if t.train_iters is not None and decay is not None and s.lr_warmup_iters >= decay:
        raise ConfigError(f"scheduler.lr_warmup_iters ({s.lr_warmup_iters}) must be smaller "
                          f"than the decay length ({decay} iterations: scheduler.lr_decay_iters "
                          f"or training.train_iters); for a short run shorten the warm-up, e.g. "
                          f"--scheduler.lr_warmup_iters {max(0, min(decay - 1, decay // 10))}")
    check_cuda_graph(cfg, torch.cuda.is_available())


def _check_kernels_device(cfg: TrainConfig) -> None:
    """Appendix C's Triton kernels on a CPU run in Triton's interpreter: refused, not crawled."""
    device = cfg.training.device
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if cfg.model.kernels == "triton" and on_cpu:
        raise ConfigError("model.kernels = 'triton' on a CPU runs Triton's interpreter (minutes "
                          "per iteration of the tiny model); use model.kernels = 'torch', or "
                          "'auto' (Triton on CUDA, torch on a CPU)")


def check_save_dir(save: str) -> None:
    """The directory the run writes to: a directory (or creatable) and writable, or a ConfigError."""
    path = Path(save)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"checkpoint.save: {save} exists and is not a directory")
    probe = path
    while not probe.exists():  # the nearest existing ancestor is where mkdir would write
        probe = probe.parent
    import tempfile

    try:  # a file made and removed: permission bits alone miss read-only mounts and root
        fd, name = tempfile.mkstemp(dir=probe, prefix=".tinytron-write-check-")
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise ConfigError(f"checkpoint.save: {save} is not writable ({probe}: "
                          f"{e.strerror or e})") from e


def check_cuda_graph(cfg: TrainConfig, cuda_available: bool) -> None:
    """`[training] cuda_graph_impl`: a known value; with "full_iteration", a run a graph can hold."""
    t, key = cfg.training, "training.cuda_graph_impl"
    if t.cuda_graph_impl not in ("none", "full_iteration"):
        raise ConfigError(f"{key} must be 'none' or 'full_iteration', got {t.cuda_graph_impl!r} "
                          "(Megatron's per-layer 'local' and 'transformer_engine' are not built "
                          "here)")
    if t.cuda_graph_impl == "none":
        return
    if t.device == "cpu" or not cuda_available:
        where = "this run is on cpu" if t.device == "cpu" else "no CUDA device is available"
        raise ConfigError(f"{key} = 'full_iteration' needs a CUDA device (a CUDA graph records "
                          f"GPU kernels) and {where}; use {key} = 'none'")
    from tinytron.reliability import ReliabilityConfig

    rel = cfg.extra.get("reliability") or ReliabilityConfig()  # absent: its defaults
    host = "a check that reads results on the host; Megatron asserts it off too, " \
        "arguments.py:1186-1188"
    cannot = {  # chapter 08's table of what a captured iteration cannot hold
        "model.recompute_granularity": (cfg.model.recompute_granularity,
                                        "recompute rewinds the CUDA generator on the host"),
        "training.step_batch_size_schedule": (t.step_batch_size_schedule,
                                              "a graph holds one micro-batch count"),
        "reliability.faults": (rel.faults, "a fault is injected at capture only"),
        "ddp.check_for_nan_in_grad": (cfg.ddp.check_for_nan_in_grad, host),
        **{f"reliability.{c}": (getattr(rel, c), host)
           for c in ("check_for_nan_in_loss_and_grad", "check_for_large_grads",
                     "check_for_spiky_loss")}}
    for name, (value, reason) in cannot.items():
        if value:
            raise ConfigError(f"{key} = 'full_iteration' cannot hold {name} = {value!r} "
                              f"({reason}); turn it off or use {key} = 'none'")
    if t.cuda_graph_warmup_steps < 1:
        raise ConfigError(f"training.cuda_graph_warmup_steps must be >= 1 (the capture needs warm "
                          f"allocations), got {t.cuda_graph_warmup_steps}")


def _graphed(cfg: TrainConfig, wrap):
    """Chapter 08's timers and checks (`wrap`) around the schedule, as one CUDA graph if asked."""
    if cfg.training.cuda_graph_impl != "full_iteration":
        return wrap
    from tinytron.reliability.full_cuda_graph import FullCudaGraphWrapper

    from tinytron.data.distribute import check_token_ids

    def check(batch):  # chapter 04's id check, on the host: inside the graph it cannot run
        if isinstance(batch, dict):
            check_token_ids(batch, cfg.model.vocab_size)
    return lambda fb: wrap(FullCudaGraphWrapper(fb, cfg.training.cuda_graph_warmup_steps,
                                                check_batch=check))


def _check_data_tokenizer(cfg: TrainConfig, tok) -> None:
    """Every data prefix's tokenizer sidecar (chapter 04) against [tokenizer]; none = not checked."""
    from tinytron.data._sidecar import describe_tokenizer, read_sidecar, sidecar_mismatch

    t = cfg.extra.get("tokenizer")
    kind, path = (t.tokenizer_type, t.tokenizer_model) if t is not None else ("byte", None)
    expected = describe_tokenizer(kind, path, tok)
    for key, word in _data_prefixes(cfg):
        try:
            info = read_sidecar(word)
        except ValueError as e:
            raise ConfigError(f"data.{key}: {e}") from e
        differ = sidecar_mismatch(info, expected) if info is not None else []
        if differ:
            made = info["tokenizer_type"] + (f" {info['tokenizer_file']}"
                                             if info.get("tokenizer_file") else "")
            raise ConfigError(
                f"data.{key}: {word} was tokenized with {made}, not this run's [tokenizer] "
                f"({'; '.join(differ)}): set tokenizer.tokenizer_type and "
                "tokenizer.tokenizer_model to the data's tokenizer")


def _check_sft_data(cfg: TrainConfig, tok) -> None:
    """`[data] sft`: chat JSONL files that exist, a tokenizer with the chat tokens (chapter 04)."""
    from tinytron.data._sft_build import chat_tokenizer, sft_paths

    t = cfg.extra.get("tokenizer")
    try:
        sft_paths(cfg.data)
        chat_tokenizer(tok, t.tokenizer_model if t is not None else None)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _data_prefixes(cfg: TrainConfig):
    """(key, prefix) of every .bin/.idx prefix [data] names (the blend weights skipped)."""
    for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        for word in getattr(cfg.data, key) or []:
            if not _is_number(word):
                yield key, str(word)


def _is_number(word) -> bool:
    try:
        float(word)
        return True
    except (TypeError, ValueError):
        return False


def build_tokenizer_for(cfg: TrainConfig):
    """The tokenizer named by [tokenizer] (chapter 04's byte or Hugging Face tokenizer)."""
    from tinytron.data.preprocess import TokenizerSpec, build_tokenizer

    t = cfg.extra.get("tokenizer")
    kind, path = (t.tokenizer_type, t.tokenizer_model) if t is not None else ("byte", None)
    try:
        if kind != "hf":
            return build_tokenizer(TokenizerSpec(kind, path))
        eod = t.eod_token or _sidecar_eod_token(cfg, path) or "<|endoftext|>"
        return build_tokenizer(TokenizerSpec(kind, path, eod, t.pad_token))
    except (ValueError, OSError) as e:
        raise ConfigError(f"tokenizer: {e}") from e


def _sidecar_eod_token(cfg: TrainConfig, path: str):
    """The end-of-document token the data was tokenized with (its sidecar's id), if recorded."""
    from tinytron.data._sidecar import read_sidecar

    if cfg.data.sft:  # chat JSONL has no sidecar
        return None
    for _, prefix in _data_prefixes(cfg):
        info = read_sidecar(prefix)
        if info and info.get("tokenizer_type") == "hf" and info.get("eod") is not None:
            from tokenizers import Tokenizer
            try:
                return Tokenizer.from_file(str(path)).id_to_token(int(info["eod"]))
            except Exception:  # noqa: BLE001 - the build below names a bad file
                return None
    return None


# -- the world --------------------------------------------------------------------------------
def _device(cfg: TrainConfig) -> torch.device:
    want = cfg.training.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device is 'cuda' but no CUDA device is available")
    return torch.device(want)


def init_distributed(device: torch.device) -> None:
    """Join torchrun's world (gloo on CPU, NCCL on CUDA), or make a one-rank world here."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        # torchrun's store outlives a restart: each attempt's keys under its own prefix
        from tinytron.reliability.restarts import init_torchrun_process_group
        init_torchrun_process_group(backend, timedelta(minutes=10))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


# -- data ---------------------------------------------------------------------------------------
def prepare_embedded_corpus(cache_dir: str, num_files: int = EMBEDDED_CORPUS_FILES) -> str:
    """The standard library's first files as one byte-tokenized .bin/.idx (built once, rank 0)."""
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus

    base = os.path.join(cache_dir, f"stdlib_{num_files}_byte")
    prefix = base + "_text_document"  # Megatron's naming: <output-prefix>_<json key>_document
    if dist.get_rank() == 0 and not os.path.isfile(prefix + ".idx"):
        os.makedirs(cache_dir, exist_ok=True)
        written = preprocess(["--input", *stdlib_corpus(num_files), "--output-prefix", base,
                              "--workers", "1", "--no-progress", "--append-eod"])
        assert written == prefix, (written, prefix)
    dist.barrier()
    return prefix


def _data_config(cfg: TrainConfig, out_dir: str):
    """cfg.data, pointed at the embedded corpus when it names no data."""
    data = cfg.data
    if not (data.data_path or data.train_data_path or data.sft):
        prefix = prepare_embedded_corpus(os.path.join(out_dir, "data"))
        data = dataclasses.replace(data, data_path=[prefix])
    if data.data_cache_path is None:
        data = dataclasses.replace(data, data_cache_path=os.path.join(out_dir, "data", "cache"))
    return data


def train_iters_of(cfg: TrainConfig, dp: int) -> int:
    """training.train_iters, or the iterations that consume train_samples (Megatron's rule)."""
    from tinytron.main_loop.microbatches import (build_num_microbatches_calculator,
                                                 train_iters_from_samples)

    t = cfg.training
    if t.train_iters is not None:
        return t.train_iters
    calc = build_num_microbatches_calculator(t.global_batch_size, t.micro_batch_size, dp,
                                             t.decrease_batch_size_if_needed,
                                             t.step_batch_size_schedule, cfg.model.seq_length)
    return train_iters_from_samples(calc, t.train_samples)


def data_iterators_provider(cfg: TrainConfig, data, tokenizer, reliability):
    """(grid, state) -> (train, valid) iterators, built after the load so they resume."""
    from tinytron.data.pipeline import (build_data_iterators, build_train_valid_test_datasets,
                                        is_dataset_built_on_rank)

    t = cfg.training

    def provide(grid, state):
        from tinytron.main_loop.loop import eval_batch

        train_iters = train_iters_of(cfg, grid.size("dp"))
        eval_runs = (train_iters // t.eval_interval + 1) if t.eval_interval else 0
        if t.skip_train:  # one evaluation of each split, from its start (training.py:4132-4142)
            eval_runs = 1
        # evaluation reads eval_global_batch_size samples a batch (training.py:4119)
        eval_gbs = eval_batch(t, grid.size("dp"))[1]
        samples = [t.train_samples or train_iters * t.global_batch_size,
                   eval_runs * t.eval_iters * eval_gbs, t.eval_iters * eval_gbs * t.skip_train]
        if data.sft:  # chat JSONL read as Megatron's --sft reads it (chapter 04's SFTDataset)
            from tinytron.data._sft_build import build_sft_datasets
            datasets = build_sft_datasets(data, cfg.model.seq_length, samples,
                                          lambda: is_dataset_built_on_rank(grid), tokenizer,
                                          grid.size("cp"))
        else:
            datasets = build_train_valid_test_datasets(
                data, cfg.model.seq_length, samples, lambda: is_dataset_built_on_rank(grid),
                eod_id=tokenizer.eod,
                pad_id=tokenizer.pad if tokenizer.pad >= 0 else tokenizer.eod)
        consumed = ([0, 0, 0] if t.skip_train else
                    [state.consumed_train_samples, state.consumed_valid_samples, 0])
        # virtual stages: one iterator per model chunk over the same samples, as Megatron builds
        # them (training.py:4256); the first chunk reads the tokens, the last the labels
        vpp = cfg.parallel.virtual_pipeline_model_parallel_size or 1
        per_chunk = [build_data_iterators(data, datasets, consumed, t.micro_batch_size, grid)
                     for _ in range(vpp)]
        train = [reliability.data_iterator(tr) for tr, _, _ in per_chunk]
        valid = [va for _, va, _ in per_chunk]
        provide.test = [te for _, _, te in per_chunk] if vpp > 1 else per_chunk[0][2]
        return (train[0], valid[0]) if vpp == 1 else (train, valid)
    provide.test = None  # the test split's iterator, built for training.skip_train only
    return provide


# -- model and optimizer ---------------------------------------------------------------------
def model_provider(cfg: TrainConfig, device: torch.device):
    """grid -> this rank's model chunks (appendix B), in the run's dtype."""
    from tinytron.model import build_stage_models

    dtype = torch.bfloat16 if cfg.training.bf16 else None
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    m = cfg.model

    def provide(grid):
        chunks = build_stage_models(m, grid, num_virtual_stages=vpp, device=device, dtype=dtype)
        if m.recompute_granularity or m.fine_grained_activation_offloading:
            from tinytron.recompute import apply_recompute  # chapter 06, before DDP wraps
            apply_recompute(chunks)
        if m.compile:  # each layer compiled in place, around chapter 06's wrappers
            from tinytron.model._compile import compile_layers
            compile_layers(chunks)
        return chunks
    return provide


def optimizer_provider(cfg: TrainConfig, reliability):
    """(chunks, grid) -> chapter 02's optimizer over every chunk, timed by chapter 08."""
    from tinytron.main_loop.loop import megatron_optimizer_provider

    build = megatron_optimizer_provider(dataclasses.replace(cfg.optimizer, bf16=cfg.training.bf16))
    return lambda model, grid: reliability.wrap_optimizer(build(model, grid))


def _scheduler_config(cfg: TrainConfig):
    """[scheduler]; evaluation only takes the checkpoint's schedule as it is (it steps nothing)."""
    if cfg.training.skip_train:
        return dataclasses.replace(cfg.scheduler, use_checkpoint_opt_param_scheduler=True)
    return cfg.scheduler


def _ddp_config(cfg: TrainConfig):
    # use_distributed_optimizer already follows [optimizer] (tinytron.config checks they agree)
    return dataclasses.replace(cfg.ddp,
                               grad_reduce_in_fp32=cfg.ddp.grad_reduce_in_fp32 or cfg.training.bf16)


# -- what the run reports --------------------------------------------------------------------
def memory_report_at_start(cfg: TrainConfig, world_size: int, device: torch.device) -> str:
    """Chapter 07's predicted ledger for the first and last stage of this layout."""
    from tinytron.memory import memory_config_from, stage_ledgers

    try:
        ledgers = stage_ledgers(memory_config_from(cfg, world_size, device=device.type))
    except Exception as e:  # noqa: BLE001 - a report: it must never stop a training run
        return f"memory (chapter 07): not predicted for this layout ({type(e).__name__}: {e})"
    picks = {f"pp rank {ledgers[0].pp_rank} (first)": ledgers[0]}
    if len(ledgers) > 1:
        picks[f"pp rank {ledgers[-1].pp_rank} (last)"] = ledgers[-1]
    lines = ["memory per rank, predicted by chapter 07 (MiB):"]
    for name, led in picks.items():
        terms = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in led.device.items() if v)
        lines.append(f"  {name}: total {led.total / 2**20:.1f} = {terms}")
    return "\n".join(lines)


def step_time_report_at_start(cfg: TrainConfig, world_size: int, device: torch.device):
    """Chapter 07's step-time model for this run: its options, this machine's rates (07.13).

    Every rank calls it (on a CPU it measures the gloo link); rank 0 prints `.text`.
    """
    from tinytron.memory._step_report import step_report_at_start

    return step_report_at_start(cfg, world_size, device)


_VERDICTS = {  # chapter 08's rerun statuses, in words
    "INITIAL_RUN": "no rerun was made",
    "FIRST_RERUN_NOT_REPRODUCIBLE": "the rerun in place gave {result:.6g}: not reproducible, a "
                                    "transient fault",
    "FIRST_RERUN_REPRODUCIBLE": "the rerun in place gave the same result: this device is "
                                "suspect",
    "SECOND_RERUN_NOT_REPRODUCIBLE": "on another device the result differs: the first device "
                                     "is faulty",
    "SECOND_RERUN_REPRODUCIBLE": "on another device the same result: the data or the model is "
                                 "at fault, not a device",
}
_EXIT_MEANING = {16: "relaunch from the checkpoint just written, preferably on other devices",
                 17: "stop, and read the tracker file before relaunching"}


def rerun_verdict(tracker_path: str | None, code: int) -> str | None:
    """What chapter 08's rerun machine found and decided, from its tracker file, in one line."""
    from tinytron.reliability.result_checks import parse_tracker_file

    events = parse_tracker_file(tracker_path)
    if not events:
        return None
    last = events[-1]
    first = next((e for e in reversed(events) if e["iteration"] == last["iteration"]
                  and e["rank"] == last["rank"] and e["status"] == "INITIAL_RUN"), last)
    verdict = _VERDICTS.get(last["status"], last["status"].lower()).format(result=last["result"])
    return (f"reliability: iteration {last['iteration']}, rank {last['rank']}: "
            f"{first['message']} (value {first['result']:.6g}); {verdict}; exit code {code}: "
            f"{_EXIT_MEANING.get(code, 'see chapter 08')} (every event: {tracker_path})")


def plot_loss_curve(jsonl_path: str, png_path: str) -> bool:
    """The training and validation loss from the JSONL log, drawn to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, valid = [], []
    for line in Path(jsonl_path).read_text().splitlines():
        r = json.loads(line)
        if "validation" in r and r.get("split", "validation") == "validation":
            valid.append((r["iteration"], r["validation"].get("lm loss")))
        elif r.get("losses", {}).get("lm loss") is not None:
            train.append((r["iteration"], r["losses"]["lm loss"]))
    if not train:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(*zip(*train), label="train lm loss")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation lm loss")
    ax.set_xlabel("iteration"), ax.set_ylabel("loss"), ax.legend()
    ax.set_title(f"tinytron.train: {Path(jsonl_path).parent.name}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True


# overrides a continuation must not repeat: where to load from (replaced by the directory just
# written), and one-shot fault injections (a resumed run would strike the same fault again)
_NOT_REPEATED = ("checkpoint.load", "checkpoint.ckpt_step", "checkpoint.finetune",
                 "reliability.faults")


def resume_argv(argv: list[str], out_dir: str, cfg: TrainConfig) -> list[str]:
    """The command line that continues this run: load = the directory it saved to, no faults."""
    out, args = [], list(argv)
    while args:
        arg = args.pop(0)
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        if key in _NOT_REPEATED:
            if "=" not in arg and args:
                args.pop(0)  # its value
            continue
        out.append(arg)
    out += ["--checkpoint.load", out_dir]
    path, overrides = _split_argv(out)
    left = load_config(path, overrides)  # what the config file still sets
    ckpt, rel = left.extra.get("checkpoint"), left.extra.get("reliability")
    if ckpt is not None and ckpt.finetune:   # the continuation is not a finetune
        out += ["--checkpoint.finetune", "false"]
    if ckpt is not None and ckpt.ckpt_step is not None:
        out += ["--checkpoint.ckpt_step", "none"]
    if rel is not None and rel.faults:
        out += ["--reliability.faults", "[]"]
    return out


def launch_command(args: list[str], world: int, env=os.environ) -> tuple[str, str]:
    """(the command that launches `args` as this run was launched, a note on where to run it).

    Under `scripts/slurm_train.sh` (it sets TINYTRON_SLURM_SCRIPT) the `sbatch` line; under
    torchrun its node and rank counts (torchrun's LOCAL_WORLD_SIZE and WORLD_SIZE); else one
    process, `tinytron-train`.
    """
    local = int(env.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // max(local, 1))
    script = env.get("TINYTRON_SLURM_SCRIPT")
    if script and env.get("SLURM_JOB_ID"):
        config, rest = _split_argv(args)
        prefix = [f"GPUS_PER_NODE={local}"] if local != 8 else []
        line = " ".join(prefix + [shlex.join(["sbatch", f"--nodes={nodes}", script,
                                              config or "", *rest])])
        return line, "(a new Slurm job, from the directory this one was submitted from)"
    if "LOCAL_WORLD_SIZE" not in env and world == 1:
        return shlex.join(["tinytron-train", *args]), ""
    head = ["torchrun", f"--nproc-per-node={local}"]
    if nodes > 1:  # the rendezvous endpoint is not visible to the ranks: name it as launched
        head = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={local}",
                "--rdzv-backend=c10d"]
        line = shlex.join([*head, "-m", "tinytron.train", *args]).replace(
            "--rdzv-backend=c10d", '--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"', 1)
        return line, (f"(on each of the {nodes} nodes; RDZV_ENDPOINT = the host:port of the "
                      "launch's --rdzv-endpoint)")
    return shlex.join([*head, "-m", "tinytron.train", *args]), ""


def _next_steps(argv: list[str], out_dir: str, cfg: TrainConfig) -> str:
    """The commands that resume, export and inspect this run."""
    launch, where_to = launch_command(resume_argv(argv, out_dir, cfg), dist.get_world_size())
    from tinytron.checkpoint.formats import read_tracker

    found = read_tracker(out_dir)
    where = (f"the run continues from its last checkpoint, iteration {found[0]}, in {out_dir}"
             if found else f"no checkpoint was written to {out_dir}: this starts the run over")
    return "\n".join([
        f"resume ({where}):",
        f"  {launch}",
        *([f"  {where_to}"] if where_to else []),
        "  (to train on to iteration N: add --training.train_iters N "
        "--scheduler.override_opt_param_scheduler true)",
        "export to Hugging Face:",
        f"  tinytron-convert to-hf {out_dir} {out_dir}/hf",
        "open the logs:",
        f"  tensorboard --logdir {os.path.join(out_dir, 'tensorboard')}",
    ])


class RunLog:
    """The loop's log_fn: chapter 08's logger, plus what a reader of the records needs.

    Every JSONL record gets a `type` ("train", "validation", or "start" for the line each
    launch writes once its checkpoint is loaded) and the `launch` number (0 for the first launch
    that wrote to this log, counted from its "start" lines), so that iterations redone after a
    restart are told apart. A validation record gets the consumed training samples (its x in
    TensorBoard's "vs samples" plots). Each validation is one console line.
    """

    def __init__(self, logger):
        self.logger, self.state = logger, None
        path = getattr(logger, "jsonl", None)
        self.launch = 0
        if logger.is_writer and path is not None and os.path.isfile(path.name):
            with open(path.name) as f:
                self.launch = sum('"type": "start"' in line for line in f)

    def start(self, state, resumed_from, world: int) -> None:
        """The launch's first record: where it starts (called once the checkpoint is loaded)."""
        import time

        jsonl = getattr(self.logger, "jsonl", None)
        if self.logger.is_writer and jsonl is not None:
            jsonl.write(json.dumps({"type": "start", "launch": self.launch,
                                    "iteration": 0 if state is None else state.iteration,
                                    "resumed_from": resumed_from and str(resumed_from),
                                    "world_size": world, "time": time.time()}) + "\n")

    def __call__(self, record: dict) -> None:
        import math

        kind = "validation" if "validation" in record else "train"
        extra = {"type": kind, "launch": self.launch}
        if kind == "validation" and self.state is not None:
            extra["consumed_train_samples"] = self.state.consumed_train_samples
        self.logger({**record, **extra})
        console = getattr(self.logger, "is_console", self.logger.is_writer)  # each node's
        if kind == "validation" and console and record["validation"]:
            losses = record["validation"]
            text = " | ".join(f"{k} {v:.4f}" for k, v in losses.items())
            lm = losses.get("lm loss")
            ppl = f" | ppl {math.exp(min(lm, 50.0)):.2f}" if lm is not None else ""
            label = ("final " if record.get("final") else "") + record.get("split", "validation")
            print(f"{label} at iteration {record['iteration']}: {text}{ppl}", flush=True)


def final_validation(cfg: TrainConfig, result, valid_iterator, forward_step_func, log_fn,
                     dtype, *, split: str = "validation", always: bool = False) -> bool:
    """Evaluate once more at the end of a run, as Megatron does (`training.py:1421-1422`).

    Skipped when the last iteration was just evaluated (the same loss twice) or when no
    validation is configured, unless `always` (training.skip_train: valid and test, once each,
    `training.py:1430-1466`); every rank takes part (the schedule's collectives).
    """
    from tinytron.main_loop._parts import any_rank, eval_batch
    from tinytron.main_loop.loop import build_schedule_config, evaluate, get_forward_backward_func

    t, grid = cfg.training, result.grid
    if not always and (not t.eval_interval or result.state.iteration == 0
                       or result.state.iteration % t.eval_interval == 0):
        return False
    if t.eval_iters < 1 or not any_rank(valid_iterator is not None, grid):  # every rank, or none
        return False
    config = build_schedule_config(
        result.model, result.optimizer, grid,
        calculate_per_token_loss=bool(getattr(cfg.ddp, "calculate_per_token_loss", False)),
        pipeline_dtype=dtype)
    fb = get_forward_backward_func(grid.size("pp"),
                                   cfg.parallel.virtual_pipeline_model_parallel_size)
    losses = evaluate(forward_step_func, valid_iterator, result.model, fb,
                      num_microbatches=eval_batch(t, grid.size("dp"))[0],
                      micro_batch_size=t.micro_batch_size, seq_length=cfg.model.seq_length,
                      eval_iters=t.eval_iters, grid=grid, config=config)
    log_fn({"iteration": result.state.iteration, "validation": losses, "final": True,
            **({"split": split} if split != "validation" else {})})
    return True


# -- the run ----------------------------------------------------------------------------------
def _reliability(cfg: TrainConfig, out_dir: str):
    from tinytron.reliability import LoggingConfig, Reliability, ReliabilityConfig

    config = cfg.extra.get("reliability") or ReliabilityConfig()
    if config.enable_ft and "MASTER_PORT" not in os.environ:
        config = dataclasses.replace(config, enable_ft=False)  # heartbeats need torchrun's store
    # one switch: tinytron.config makes [reliability] follow [training] (--exit-signal-handler)
    config = dataclasses.replace(config, exit_signal_handler=cfg.training.exit_signal_handler)
    log = cfg.extra.get("logging") or LoggingConfig()  # the timers' level lives in [logging]
    return Reliability(config, save_dir=out_dir, timing_log_level=log.timing_log_level,
                       timing_log_option=log.timing_log_option)


def _logger(cfg: TrainConfig, out_dir: str, train_iters: int, device, reliability):
    from tinytron.reliability import LoggingConfig, MetricsLogger

    config = cfg.extra.get("logging") or LoggingConfig()
    config = dataclasses.replace(
        config, jsonl_path=config.jsonl_path or os.path.join(out_dir, "log.jsonl"),
        tensorboard_dir=config.tensorboard_dir or os.path.join(out_dir, "tensorboard"))
    names = ["forward-backward", "optimizer", "save-checkpoint"]
    return MetricsLogger(config, train_iters, device=device, timers=reliability.timers,
                         timer_names=names), config


def _checkpoint_hooks(cfg: TrainConfig, out_dir: str, grid, reliability, plan):
    """Chapter 03's hooks, loading what `load_plan` decided, wrapped by chapter 08's."""
    from tinytron.checkpoint import CheckpointConfig, make_checkpoint_hooks

    config = cfg.extra.get("checkpoint") or CheckpointConfig()
    config = dataclasses.replace(config, save=None if cfg.never_save else (config.save or out_dir),
                                 load=plan.load, ckpt_step=plan.ckpt_step)
    if plan.continues_save:  # the run's own checkpoint: how to take `load`'s does not apply
        config = dataclasses.replace(config, finetune=False, no_load_optim=False,
                                     no_load_rng=False)
    if cfg.training.skip_train:  # nothing steps: the optimizer state is not read (:1662-1664)
        config = dataclasses.replace(config, no_load_optim=True)
    hooks = make_checkpoint_hooks(config, grid, rerun_state_machine=reliability.rsm)
    save, load = reliability.checkpoint_hooks(hooks.save_checkpoint_fn, hooks.load_checkpoint_fn)
    return (save, load, hooks.finalize_async_save_fn, hooks.manager.comm.destroy, config,
            hooks.manager.saver)


class LoadRefused(ConfigError):
    """Chapter 03 refused the checkpoint (every rank agrees): one line, exit status 2."""


class DataRefused(ConfigError):
    """Chapter 04 cannot build the datasets the config asks for: one line, exit status 2."""


def _restored(config, plan) -> str:
    """What a load restores, in words (chapter 03's options)."""
    from tinytron.checkpoint._load_dir import saved_parts

    has = saved_parts(plan.directory)
    if plan.release:
        return "model weights only (a release checkpoint: iteration, optimizer, scheduler, RNG " \
               "and data position start fresh)"
    if config.finetune:
        return "model weights only (checkpoint.finetune: iteration, optimizer, scheduler, RNG " \
               "and data position start fresh)"
    parts = ["model weights"]
    parts.append("optimizer state" if has["optimizer"] and not config.no_load_optim else
                 "no optimizer state (" + ("checkpoint.no_load_optim" if has["optimizer"] else
                                           "none saved") + ": fp32 masters from the weights)")
    parts.append("scheduler" if has["scheduler"] else "no scheduler state (none saved)")
    parts.append("RNG states" if has["rng"] and not config.no_load_rng else
                 "no RNG states (" + ("checkpoint.no_load_rng" if has["rng"] else "none saved")
                 + ")")
    parts.append(f"data position ({has['consumed_train_samples']} samples consumed)")
    return ", ".join(parts)


def _reporting_hooks(save, load, *, rank: int, out_dir: str, cfg: TrainConfig, config, plan,
                     run_log=None, saver=None):
    """The checkpoint hooks, saying on the console what they did (rank 0).

    The run's config.toml is written once the load has succeeded, so a run refused at the load
    leaves the directory as it was.
    """
    import time

    def reporting_load(model, optimizer, scheduler):
        try:
            state = load(model, optimizer, scheduler)
        except ValueError as e:  # every rank agreed on it (chapter 03's first_error): a user error
            raise LoadRefused(str(e)) from e
        if run_log is not None:
            run_log.start(state, plan.directory if state is not None else None,
                          dist.get_world_size())
        if rank == 0:
            if not cfg.training.skip_train:  # an evaluation leaves the run's config as it was
                (Path(out_dir) / "config.toml").write_text(cfg.to_toml())
            if state is None:
                print(f"checkpoint: starting fresh at iteration 0: {plan.fresh_reason}")
            else:
                print(f"checkpoint: resumed from {plan.directory} at iteration {state.iteration}"
                      f"; restored {_restored(config, plan)}", flush=True)
        return state

    def reporting_save(state, model, optimizer, scheduler):
        t0 = time.perf_counter()
        save(state, model, optimizer, scheduler)
        if rank == 0 and config.save is not None:
            where = os.path.join(config.save, f"iter_{state.iteration:07d}")
            staged = saver is not None and saver.pending is not None and \
                saver.pending.stats.get("staged")
            how = ("written" if not config.async_save else
                   "queued (its copy to host staged behind the next forward and backward), "
                   "written in the background" if staged else
                   "queued, written in the background")
            print(f"checkpoint: iteration {state.iteration} {how} to {where} "
                  f"(training blocked {time.perf_counter() - t0:.2f} s)", flush=True)
    return reporting_save, reporting_load


_HELD_LOCKS: list = []  # this process's save-directory lock (rank 0), released when run() ends


def hold_save_dir(out_dir: str):
    """Rank 0 locks the save directory for the run's life; every rank refuses alike if taken."""
    from tinytron.reliability._run_lock import lock_save_dir

    held, refused = None, [None]
    if dist.get_rank() == 0:
        try:
            held = lock_save_dir(out_dir)
        except ValueError as e:
            refused = [str(e)]
    dist.broadcast_object_list(refused, src=0)
    if refused[0] is not None:
        raise ConfigError(refused[0])
    return held


def release_save_dir() -> None:
    while _HELD_LOCKS:
        lock = _HELD_LOCKS.pop()
        if lock is not None:
            lock.close()


def output_dir(cfg: TrainConfig, name: str = "run") -> str:
    """Where the run writes: [checkpoint] save, else runs/<name of the config file>.

    With `checkpoint.save = none` (or "") no checkpoint is written and the run's logs go to a
    new directory of its own under the system's temporary directory (`scratch_dir`), so that
    nothing of runs/<name> is read or written.
    """
    ckpt = cfg.extra.get("checkpoint")
    return ckpt.save if ckpt is not None and ckpt.save else os.path.join("runs", name)


def scratch_dir(name: str) -> str:
    """A new directory for the logs of a run that saves nothing: made by rank 0, the same on all."""
    import tempfile

    path = [tempfile.mkdtemp(prefix=f"tinytron-{name}-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    os.makedirs(path[0], exist_ok=True)  # another node's ranks: their own temporary directory
    return path[0]


def run(cfg: TrainConfig, argv: list[str], name: str = "run") -> int:
    """Train (or resume) as cfg says; return the process exit code."""
    from tinytron.main_loop.loop import gpt_forward_step, megatron_scheduler_provider
    from tinytron.main_loop.run import pretrain
    from tinytron.main_loop.training_log import (num_floating_point_operations,
                                                 peak_flops_per_device)
    from tinytron.parallel import ParallelGrid

    device = _device(cfg)
    init_distributed(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp, _, cp = cfg.parallel.sizes()
    grid = ParallelGrid(tp=tp, pp=pp, cp=cp)
    out_dir = scratch_dir(name) if cfg.never_save else output_dir(cfg, name)
    plan = load_plan(cfg, name)
    os.makedirs(out_dir, exist_ok=True)
    if not cfg.never_save:  # chapter 08: one run at a time per save directory, or exit 2
        _HELD_LOCKS.append(hold_save_dir(out_dir))
    step_report = step_time_report_at_start(cfg, world, device)  # every rank: CPU rates
    if rank == 0:
        print(f"tinytron.train: world {world} = tp {tp} · pp {pp} · cp {cp} · dp "
              f"{cfg.data_parallel_size(world)} on {device.type}; writing to {out_dir}"
              + (" (checkpoint.save none: no checkpoint is written)" if cfg.never_save else ""))
        print(memory_report_at_start(cfg, world, device), flush=True)
        print(step_report.text, flush=True)
        if plan.note:
            print(f"checkpoint: {plan.note}", flush=True)
    tokenizer = build_tokenizer_for(cfg)
    data = _data_config(cfg, out_dir)
    rel = _reliability(cfg, out_dir)
    train_iters = train_iters_of(cfg, grid.size("dp"))
    logger, log_config = _logger(cfg, out_dir, train_iters, device, rel)
    save, load, finalize, close_checkpoint_groups, ckpt_config, saver = _checkpoint_hooks(
        cfg, out_dir, grid, rel, plan)
    # a staged async save copies to host behind the next forward/backward and is waited for
    # only just before the next optimizer.step (chapter 03's wait point)
    before_step = saver.before_optimizer_step if saver is not None else None
    log_fn, iterators = RunLog(logger), {}
    save, load = _reporting_hooks(save, load, rank=rank, out_dir=out_dir, cfg=cfg,
                                  config=ckpt_config, plan=plan, run_log=log_fn, saver=saver)
    seq, mbs = cfg.model.seq_length, cfg.training.micro_batch_size
    dtype = torch.bfloat16 if cfg.training.bf16 else torch.float32
    provide_data = data_iterators_provider(cfg, data, tokenizer, rel)

    def provide_and_keep(grid_, state):
        log_fn.state = state  # the loop's own TrainState: the samples a validation follows
        try:
            iterators["train"], iterators["valid"] = provide_data(grid_, state)
        except ValueError as e:  # chapter 04 names the dataset and what it lacks: a user error
            raise DataRefused(f"data: {e}") from e
        return iterators["train"], iterators["valid"]
    forward_step = partial(gpt_forward_step, micro_batch_size=mbs, seq_length=seq,
                           sft=cfg.data.sft)
    # MFU needs a peak: a GPU's datasheet peak. A CPU's measured matmul rate moves with the
    # shape, the threads and whatever else runs, and a run can beat it (101% was seen), so on
    # a CPU the logs give tokens/s and TFLOP/s (tflops_per_device in the JSONL), not MFU.
    peak_flops = peak_flops_per_device(device, dtype) if device.type == "cuda" else None
    if rank == 0 and peak_flops is None:
        where = ("this GPU (no datasheet peak is known for it)" if device.type == "cuda"
                 else "CPU (it has no reliable peak)")
        print(f"MFU: not reported on {where}; the JSONL has tokens_per_second and "
              "tflops_per_device", flush=True)
    from tinytron.data.distribute import TokenIdError

    try:
        with rel.signal_handler or contextlib.nullcontext() as handler:
            result = pretrain(
                cfg.training, model_provider=model_provider(cfg, device),
                forward_step_func=rel.forward_step_func(forward_step),
                data_iterators_provider=provide_and_keep,
                optimizer_provider=optimizer_provider(cfg, rel),
                scheduler_provider=megatron_scheduler_provider(_scheduler_config(cfg),
                                                               cfg.optimizer),
                grid_provider=lambda: grid, ddp_config=_ddp_config(cfg), seq_length=seq,
                vpp_size=cfg.parallel.virtual_pipeline_model_parallel_size,
                schedule_overrides={"pipeline_dtype": dtype, **cfg.parallel.p2p_schedule_options()},
                load_checkpoint_fn=load, save_checkpoint_fn=save, finalize_async_save_fn=finalize,
                before_optimizer_step_fn=before_step,
                flops_fn=lambda batch: num_floating_point_operations(cfg.model, batch),
                peak_flops=peak_flops, log_fn=log_fn,
                exit_signal=handler, rerun_state_machine=rel.rsm, step_hooks=rel,
                iterations_to_skip=rel.iterations_to_skip,
                wrap_forward_backward_func=_graphed(cfg, rel.forward_backward_func))
        if handler is not None and handler.received_signals:
            handler.keep_absorbing()  # torchrun's copy of the Ctrl-C may still be on its way
        if result.exit_reason is None:
            skip = cfg.training.skip_train  # evaluation only: valid, then test, whatever ran
            final_validation(cfg, result, iterators.get("valid"), forward_step, log_fn, dtype,
                             always=skip)
            if skip:
                final_validation(cfg, result, provide_data.test, forward_step, log_fn, dtype,
                                 split="test", always=True)
        logger.flush_timers(result.state.iteration)  # the final save's time, in TensorBoard
    except TokenIdError as e:  # the data holds ids the model cannot: checked on the host
        raise DataRefused(f"data: {e}; the data was tokenized with a larger vocabulary than "
                          "model.vocab_size") from e
    finally:
        rel.shutdown()
        logger.close()
        close_checkpoint_groups()  # their threads and sockets: a second run() starts clean
        grid.destroy()
        release_save_dir()  # the checkpoint is complete: the directory is free again
    code = rel.exit_code(result.exit_reason)
    if logger.is_writer and log_config.jsonl_path and os.path.isfile(log_config.jsonl_path):
        png = os.path.join(out_dir, "loss.png")
        if plot_loss_curve(log_config.jsonl_path, png):
            print(f"loss curve: {png}")
        if result.exit_reason == "rerun":
            line = rerun_verdict(rel.rerun_config.result_rejected_tracker_filename, code)
            if line:
                print(line)
        from tinytron.memory._step_report import step_report_at_end
        if (line := step_report_at_end(step_report, log_config.jsonl_path)) is not None:
            print(line)  # chapter 07's prediction beside this run's measured step
        reason = result.exit_reason or ("training.skip_train: evaluated only"
                                        if cfg.training.skip_train else "train_iters reached")
        print(f"stopped at iteration {result.state.iteration} (reason: {reason}), "
              f"exit code {code}")
        if _split_argv(argv)[0] is not None:  # a command line to continue (not a config
            print(_next_steps(argv, out_dir, cfg), flush=True)  # built in memory)
    return code


def _report_error(e: Exception) -> int:
    """One line on stderr, from global rank 0 only (every rank finds the same error): status 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"tinytron.train: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    """`python -m tinytron.train` / `tinytron-train`: exit 0, 2 on a config error, 16-18 from chapter 08.

    Under torchrun each rank returns that status; torchrun itself exits 1 when any rank
    fails (its summary names each rank's `exitcode`), 0 when all succeed.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_only = "--check" in argv  # check the config for WORLD_SIZE ranks, start nothing
    argv = [a for a in argv if a != "--check"]
    try:
        cfg = resolve_config(argv, world)
        path = _split_argv(argv)[0]
    except ConfigError as e:
        return _report_error(e)
    if check_only:
        print(f"tinytron.train: the config is valid for world size {world}", flush=True)
        return 0
    try:
        return run(cfg, argv, Path(path).stem if path else "run")
    except ConfigError as e:  # a checkpoint chapter 03 refused, found by every rank alike
        return _report_error(e)
    finally:
        release_save_dir()
        if dist.is_initialized():
            dist.destroy_process_group()


def console_main() -> None:
    """The `tinytron-train` console script."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
