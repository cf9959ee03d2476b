"""One run's configuration: each chapter's own config dataclass, composed, loaded from TOML.

A run is described by a TOML file whose sections are the chapters' configs under Megatron's
names (``[model]`` is ``tinytron.model.ModelConfig``, ``[optimizer]`` is
``tinytron.optimizer.OptimizerConfig``, ...), plus two sections owned here: ``[parallel]`` (the
layout) and ``[training]`` (batch sizes, iterations, intervals). Command-line overrides use
dotted names: ``--model.hidden_size 128`` or ``--training.train_iters=20``.

Everything is checked before any process group exists, and every error is one line that names
the field: an unknown key (with the nearest valid name), a wrong type, or a layout that cannot
be cut (world size != tp·pp·cp·dp, heads not divisible by tp, a global batch that micro-batches
do not divide).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["ParallelConfig", "TrainingConfig", "TokenizerConfig", "TrainConfig", "SECTIONS",
           "load_config", "config_help",
           "parse_overrides", "ConfigError"]


class ConfigError(ValueError):
    """A user error in a config file or override; the message is one line naming the field."""


@dataclass
class ParallelConfig:
    """The layout (Megatron's names); dp = world_size / (tp · pp · cp)."""

    tensor_model_parallel_size: int = 1
    """TP: each layer's weights split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: the layers cut into this many stages."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """VPP: model chunks per pipeline rank (interleaved 1F1B); None = 1."""
    context_parallel_size: int = 1
    """CP: the sequence split over this many ranks for attention."""
    overlap_p2p_comm: bool = True
    """Interleaved 1F1B: post the p2p messages async (Megatron's default); off needs PP > 2.
    Without interleaving the schedule gets it off, as Megatron sets it (arguments.py:989-991)."""
    batch_p2p_comm: Optional[bool] = None
    """Pipeline p2p as one batch_isend_irecv per exchange, else single isend/irecv; None = not
    overlap_p2p_comm (Megatron's argument_utils.py:302); true is refused with overlap_p2p_comm."""

    def sizes(self) -> tuple[int, int, int, int]:
        """(tp, pp, vpp, cp) with vpp None read as 1."""
        vpp = self.virtual_pipeline_model_parallel_size or 1
        return (self.tensor_model_parallel_size, self.pipeline_model_parallel_size, vpp,
                self.context_parallel_size)

    def p2p_schedule_options(self) -> dict:
        """overlap_p2p_comm and batch_p2p_comm as the schedule gets them: one p2p method for
        every message (NCCL matches a batched message only with a batched one)."""
        overlap = self.overlap_p2p_comm and self.sizes()[2] > 1
        batch = not overlap if self.batch_p2p_comm is None else self.batch_p2p_comm
        if batch and overlap:
            raise ConfigError("parallel.batch_p2p_comm = true needs parallel.overlap_p2p_comm = "
                              "false: overlapped p2p posts single isend/irecv "
                              "(model_parallel_config.py:304-312)")
        return {"overlap_p2p_comm": overlap, "batch_p2p_comm": batch}


@dataclass
class TrainingConfig:
    """Batch sizes, length of the run and its intervals (Megatron's names and defaults)."""

    micro_batch_size: int = 1
    """Samples per forward/backward on one rank."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all DP ranks; None = micro_batch_size · dp."""
    step_batch_size_schedule: Optional[str] = None
    """Megatron's "THRESHOLD:BS ..." schedule, thresholds in tokens, e.g. "0:16 1M:32"; the LR
    schedule's lengths are the samples their iterations consume under it."""
    decrease_batch_size_if_needed: bool = False
    """Round the global batch down to a multiple of micro_batch_size · dp instead of failing."""
    train_iters: Optional[int] = None
    """Iterations to train (exactly one of train_iters / train_samples)."""
    train_samples: Optional[int] = None
    """Samples to train."""
    eval_interval: Optional[int] = 1000
    """Evaluate every this many iterations (None = never)."""
    eval_iters: int = 100
    """Batches per evaluation."""
    eval_global_batch_size: Optional[int] = None
    """Samples per evaluation batch over all DP ranks; None = global_batch_size (Megatron's)."""
    save_interval: Optional[int] = None
    """Save a checkpoint every this many iterations (None = only at the end)."""
    exit_interval: Optional[int] = None
    """Stop (after saving) when the iteration is a multiple of this."""
    exit_duration_in_mins: Optional[float] = None
    """Stop (after saving) after this many minutes."""
    exit_signal_handler: bool = False
    """Save and stop cleanly on SIGTERM (the one switch: [reliability] follows it)."""
    log_interval: int = 100
    """Print a log line every this many iterations."""
    seed: int = 1234
    """Seed of the data order, dropout and RNG tracker (the model init has its own seed)."""
    bf16: bool = False
    """Train with bf16 params and fp32 main grads/master weights."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" (cuda when available)."""
    cuda_graph_impl: str = "none"
    """"none", or "full_iteration": each iteration's forward-backward captured once as one CUDA
    graph and replayed (chapter 08; CUDA only, refused on CPU; Megatron's --cuda-graph-impl)."""
    cuda_graph_warmup_steps: int = 3
    """Eager iterations before the full-iteration graph is captured (Megatron's default)."""
    skip_train: bool = False
    """Evaluate the loaded checkpoint on the valid and test splits and exit (Megatron's --skip-train)."""


@dataclass
class TokenizerConfig:
    """Which tokenizer produced the data (Megatron's --tokenizer-type / --tokenizer-model)."""

    tokenizer_type: str = "byte"
    """"byte" (chapter 00's byte tokenizer, the embedded corpus) or "hf" (a tokenizer.json)."""
    tokenizer_model: Optional[str] = None
    """Path of the Hugging Face tokenizer.json when tokenizer_type is "hf"."""
    eod_token: Optional[str] = None
    """End-of-document token of an "hf" tokenizer ("</s>" for Llama-2); None = the data's sidecar's, else "<|endoftext|>"."""
    pad_token: Optional[str] = None
    """Padding token of an "hf" tokenizer; None = "<|pad|>" or "<pad>" when it has one, else none."""

    def __post_init__(self):
        if self.tokenizer_type not in ("byte", "hf"):
            raise ValueError(f"tokenizer_type must be 'byte' or 'hf', got {self.tokenizer_type!r}")
        if self.tokenizer_type == "hf" and not self.tokenizer_model:
            raise ValueError("tokenizer_type 'hf' needs tokenizer_model (a tokenizer.json path)")


# section name -> "module:ClassName"; imported lazily so that reading a config is cheap.
SECTIONS: dict[str, str] = {
    "model": "tinytron.model.config:ModelConfig",
    "parallel": "tinytron.config:ParallelConfig",
    "training": "tinytron.config:TrainingConfig",
    "optimizer": "tinytron.optimizer.factory:OptimizerConfig",
    "scheduler": "tinytron.optimizer.factory:SchedulerConfig",
    "ddp": "tinytron.buffers.distributed_data_parallel:DistributedDataParallelConfig",
    "data": "tinytron.data.pipeline:DataConfig",
    "tokenizer": "tinytron.config:TokenizerConfig",
    "checkpoint": "tinytron.checkpoint.resume:CheckpointConfig",
    "logging": "tinytron.reliability.observability:LoggingConfig",
    "reliability": "tinytron.reliability.loop_hooks:ReliabilityConfig",
}


def _section_class(name: str) -> type:
    module, cls = SECTIONS[name].split(":")
    return getattr(importlib.import_module(module), cls)


# -- values: TOML types checked against the dataclass annotations ------------------------------
def _parse_cli_value(text: str) -> Any:
    """A command-line value read as TOML (64, 3e-4, true, "x", [1, 2]), else as a plain string."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _accepts(hint, value) -> tuple[bool, Any]:
    """(ok, converted value) for `value` against a resolved type hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            ok, out = _accepts(arm, value)
            if ok:
                return True, out
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is Any:
        return True, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if hint is str:
        return isinstance(value, str), value
    base = origin or hint
    if base in (list, tuple, Sequence):  # a string too: see _bare_list
        ok = isinstance(value, (list, tuple, str))
        return ok, list(value) if isinstance(value, tuple) else value
    if base is dict:
        return isinstance(value, dict), value
    return isinstance(value, base) if isinstance(base, type) else True, value


# sections whose dataclass splits a string itself ([data]: "0.3 a 0.7 b", Megatron's blend)
_SPLITS_STRINGS = ("data",)
LIST_SYNTAX = ("a TOML list ('[\"nan@25\", \"kill@30\"]') or bare words separated by commas "
               "or spaces ('nan@25,kill@30')")


def _is_list_hint(hint) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_list_hint(a) for a in typing.get_args(hint))
    return (typing.get_origin(hint) or hint) in (list, tuple, Sequence)


def _bare_list(section: str, hint, value):
    """A string given for a list field -> its words (`--reliability.faults nan@25`)."""
    if isinstance(value, str) and section not in _SPLITS_STRINGS and _is_list_hint(hint):
        return [w for w in re.split(r"[,\s]+", value.strip()) if w]
    return value


def _type_name(hint) -> str:
    if typing.get_origin(hint) is not None:
        return str(hint).replace("typing.", "").replace("NoneType", "None")
    return getattr(hint, "__name__", None) or str(hint)


RENAMED_KEYS = {"training.rampup_batch_size": "; it is now training.step_batch_size_schedule "
                "(Megatron's name; thresholds in tokens, not samples)"}


def _build_section(name: str, values: dict) -> Any:
    """The section's dataclass from a dict, with one-line errors for unknown keys and types."""
    if not isinstance(values, dict):
        raise ConfigError(f"[{name}] must be a table of key = value, got {values!r}")
    cls = _section_class(name)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {name}.{near[0]}?" if near else ""
            hint = RENAMED_KEYS.get(f"{name}.{key}", hint)
            raise ConfigError(f"unknown config key {name}.{key}{hint}")
        value = _bare_list(name, hints[key], value)
        ok, converted = _accepts(hints[key], value)
        if not ok:
            syntax = f", as {LIST_SYNTAX}" if _is_list_hint(hints[key]) else ""
            raise ConfigError(f"{name}.{key} must be {_type_name(hints[key])}{syntax}, "
                              f"got {value!r} ({type(value).__name__})")
        kwargs[key] = converted
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
                   and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        raise ConfigError(f"[{name}] is missing required keys: "
                          f"{', '.join(f'{name}.{m}' for m in missing)}") from e
    except ValueError as e:
        raise ConfigError(f"[{name}] {e}") from e


# -- the whole run ---------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Every section of one run; `resolve(world_size)` checks the layout and derives dp."""

    model: Any
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: Any = None
    scheduler: Any = None
    ddp: Any = None
    data: Any = None
    extra: dict = field(default_factory=dict)
    """Sections registered by later chapters (checkpoint, logging, reliability), built as given."""
    never_save: bool = False
    """`[checkpoint] save` was given as none or "": no checkpoint is written (absent: the
    trainer saves to runs/<config name>)."""

    @classmethod
    def from_dict(cls, raw: dict) -> "TrainConfig":
        """Build and type-check every section; unknown sections are an error."""
        unknown = [k for k in raw if k not in SECTIONS]
        if unknown:
            near = difflib.get_close_matches(unknown[0], list(SECTIONS), n=1)
            hint = f"; did you mean [{near[0]}]?" if near else ""
            raise ConfigError(f"unknown config section [{unknown[0]}]{hint}")
        if "model" not in raw:
            raise ConfigError("the config has no [model] section")
        raw = _reliability_follows_training(_ddp_follows_optimizer(raw))
        ckpt = raw.get("checkpoint")
        never_save = isinstance(ckpt, dict) and "save" in ckpt and ckpt["save"] in (None, "")
        if never_save:  # "" (TOML has no null) and none mean the same: never save
            raw = {**raw, "checkpoint": {**ckpt, "save": None}}
        built = {name: _build_section(name, raw.get(name, {})) for name in SECTIONS
                 if name in raw or name != "model"}
        core = {k: built.pop(k) for k in ("model", "parallel", "training", "optimizer",
                                          "scheduler", "ddp", "data")}
        return cls(**core, extra=built, never_save=never_save)

    def data_parallel_size(self, world_size: int) -> int:
        """dp = world / (tp · pp · cp), or a ConfigError naming the numbers."""
        tp, pp, _, cp = self.parallel.sizes()
        for key, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                          ("context_parallel_size", cp)):
            if size < 1:
                raise ConfigError(f"parallel.{key} must be >= 1, got {size}")
        if world_size % (tp * pp * cp):
            raise ConfigError(f"world size {world_size} is not divisible by tp·pp·cp = "
                              f"{tp}·{pp}·{cp} = {tp * pp * cp}")
        return world_size // (tp * pp * cp)

    def resolve(self, world_size: int) -> "TrainConfig":
        """Check the whole layout for this world size; fill global_batch_size. Returns self."""
        dp = self.data_parallel_size(world_size)
        tp, pp, vpp, cp = self.parallel.sizes()
        try:
            self.model.check_layout(tp=tp, cp=cp, pp=pp, num_virtual_stages=vpp)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from e
        if vpp == 1 and self.ddp is not None and self.ddp.align_param_gather:
            # only the interleaved schedule dispatches the gathers (param_sync_func); without it
            # the aligned pre-hooks would prefetch nothing: off, as Megatron sets it
            # (arguments.py:990-992)
            self.ddp.align_param_gather = False
        p2p = self.parallel.p2p_schedule_options()
        if vpp > 1 and pp <= 2 and p2p["batch_p2p_comm"]:
            raise ConfigError("parallel.overlap_p2p_comm = false needs pipeline_model_parallel_size"
                              f" > 2 with interleaving, got {pp} (arguments.py:984-988; or set "
                              "parallel.batch_p2p_comm = false)")
        t = self.training
        _check_training_values(self)
        per_step = t.micro_batch_size * dp
        if t.step_batch_size_schedule is not None and t.global_batch_size is not None:
            raise ConfigError("set training.step_batch_size_schedule or training.global_batch_size, "
                              "not both (megatron/training/arguments.py:696-699)")
        if t.global_batch_size is None:
            t.global_batch_size = per_step
        if t.global_batch_size % per_step and not t.decrease_batch_size_if_needed:
            raise ConfigError(f"training.global_batch_size ({t.global_batch_size}) must be "
                              f"divisible by micro_batch_size·dp = {t.micro_batch_size}·{dp} "
                              f"= {per_step}")
        if t.global_batch_size % per_step and t.eval_global_batch_size is None:
            # decrease_batch_size_if_needed: evaluation follows the decreased batch, not the asked
            t.eval_global_batch_size = t.global_batch_size // per_step * per_step
            if t.eval_global_batch_size == 0:
                raise ConfigError(f"training.global_batch_size ({t.global_batch_size}) is smaller "
                                  f"than micro_batch_size·dp = {per_step}: decreasing it leaves "
                                  "no sample")
        if t.skip_train and t.train_iters is None and t.train_samples is None:
            t.train_iters = 0  # evaluation only: the run's length is not needed
        if t.train_iters == 0 and not t.skip_train:
            raise ConfigError("training.train_iters must be >= 1; to evaluate a checkpoint "
                              "without training set training.skip_train = true")
        if (t.train_iters is None) == (t.train_samples is None):
            raise ConfigError("set exactly one of training.train_iters and training.train_samples")
        num_microbatches = t.global_batch_size // per_step
        if vpp > 1 and num_microbatches % pp:
            raise ConfigError(f"interleaving needs the number of micro-batches "
                              f"({num_microbatches}) divisible by "
                              f"pipeline_model_parallel_size ({pp})")
        return self

    def to_dict(self) -> dict:
        """Plain nested dict of every section (what is printed at start and saved)."""
        out = {}
        for name in SECTIONS:
            value = getattr(self, name) if hasattr(self, name) else self.extra.get(name)
            if value is not None and dataclasses.is_dataclass(value):
                out[name] = {k: v for k, v in dataclasses.asdict(value).items()}
        return out

    def to_toml(self) -> str:
        """The resolved config as TOML (None values are left out: TOML has no null)."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is not None and not (isinstance(value, dict) and not value):
                    if key == "global_batch_size" and values.get("step_batch_size_schedule"):
                        continue  # filled in by resolve; the schedule sets the batch
                    lines.append(f"{key} = {_toml_value(value)}")
            if section == "checkpoint" and self.never_save:
                lines.append('save = ""')  # read back: never save (absent would mean runs/<name>)
            lines.append("")
        return "\n".join(lines)


def _check_training_values(cfg: "TrainConfig") -> None:
    """Values no run can use, each named before anything starts (one ConfigError line)."""
    t = cfg.training
    for key in ("micro_batch_size", "log_interval", "eval_iters"):
        low = 0 if key == "eval_iters" else 1
        if getattr(t, key) < low:
            raise ConfigError(f"training.{key} must be >= {low}, got {getattr(t, key)}")
    for key in ("global_batch_size", "eval_global_batch_size", "train_iters", "train_samples",
                "eval_interval", "save_interval", "exit_interval"):
        value, low = getattr(t, key), 1 if "batch" in key else 0  # an interval of 0 is off
        if value is not None and value < low:
            raise ConfigError(f"training.{key} must be >= {low} (or none), got {value}")
    opt = cfg.optimizer
    if opt is not None and opt.lr is not None and opt.min_lr > opt.lr:
        raise ConfigError(f"optimizer.min_lr ({opt.min_lr}) is larger than optimizer.lr "
                          f"({opt.lr}): the decay would raise the learning rate")
    if t.step_batch_size_schedule is not None:
        from tinytron.main_loop.microbatches import parse_step_batch_size_schedule
        try:
            parse_step_batch_size_schedule(str(t.step_batch_size_schedule),
                                           cfg.model.seq_length)
        except ValueError as e:
            raise ConfigError(f"training.step_batch_size_schedule "
                              f"{t.step_batch_size_schedule!r}: {e}") from e
    if cfg.data is not None and getattr(cfg.data, "sft", False):
        _check_sft_layout(cfg)
    _check_validation_split(cfg)


def _check_sft_layout(cfg: "TrainConfig") -> None:
    """[data] sft: one packed row per micro-batch, and no pipeline middle stage."""
    t = cfg.training
    if t.micro_batch_size != 1:
        raise ConfigError(f"data.sft needs training.micro_batch_size 1, got {t.micro_batch_size}"
                          " (a packed row's cu_seqlens differ from row to row; a longer "
                          "model.seq_length packs more per micro-batch)")
    pp = cfg.parallel.pipeline_model_parallel_size if cfg.parallel is not None else 1
    if pp > 2:
        raise ConfigError(f"data.sft with parallel.pipeline_model_parallel_size {pp}: a middle "
                          "stage would attend without its block-causal mask; use at most 2 "
                          "pipeline stages for SFT")


def _check_validation_split(cfg: "TrainConfig") -> None:
    """An eval_interval with a split that gives validation nothing would never validate."""
    t, data = cfg.training, cfg.data
    if t.skip_train or not (t.eval_interval and t.eval_iters) or data is None:
        return
    if not data.data_path or data.valid_data_path:
        return  # the embedded corpus (the default split), or a validation path of its own
    from tinytron.data.gpt_dataset import parse_and_normalize_split
    try:
        weights = parse_and_normalize_split(data.split)
    except ValueError:
        return  # [data] names it
    if weights[1] == 0:
        raise ConfigError(f"data.split {data.split!r} leaves no validation data but "
                          f"training.eval_interval is {t.eval_interval}: give validation a "
                          "share (e.g. \"98,2,0\") or set training.eval_interval none")


def _ddp_follows_optimizer(raw: dict) -> dict:
    """[ddp] use_distributed_optimizer is [optimizer]'s (one switch in Megatron's CLI)."""
    optimizer, ddp = raw.get("optimizer", {}), raw.get("ddp", {})
    if not isinstance(optimizer, dict) or not isinstance(ddp, dict):
        return raw  # not tables: _build_section names the problem
    default = _section_class("optimizer").__dataclass_fields__["use_distributed_optimizer"].default
    opt = optimizer.get("use_distributed_optimizer", default)
    if ddp.get("use_distributed_optimizer", opt) != opt:
        raise ConfigError(f"ddp.use_distributed_optimizer ({ddp['use_distributed_optimizer']}) "
                          f"disagrees with optimizer.use_distributed_optimizer ({opt}); "
                          "set it in [optimizer] only")
    return {**raw, "ddp": {**ddp, "use_distributed_optimizer": opt}}


def _reliability_follows_training(raw: dict) -> dict:
    """[reliability] exit_signal_handler is [training]'s (Megatron's one --exit-signal-handler)."""
    training, rel = raw.get("training", {}), raw.get("reliability", {})
    if not isinstance(training, dict) or not isinstance(rel, dict):
        return raw
    on = training.get("exit_signal_handler", False)
    if "exit_signal_handler" in rel and rel["exit_signal_handler"] != on:
        raise ConfigError(f"reliability.exit_signal_handler ({rel['exit_signal_handler']}) "
                          f"disagrees with training.exit_signal_handler ({on}); "
                          "set it in [training] only")
    if "reliability" not in raw and not on:
        return raw
    return {**raw, "reliability": {**rel, "exit_signal_handler": on}}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int,)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_help(sections: Sequence[str] | None = None) -> str:
    """Every section's keys with their default and one-line meaning (the fields' docstrings)."""
    from tinytron._fields import _field_docs

    lines = []
    for name in sections or SECTIONS:
        cls = _section_class(name)
        docs: dict = {}
        for klass in reversed(cls.__mro__):
            if dataclasses.is_dataclass(klass):
                docs.update(_field_docs(klass))
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        lines.append(f"[{name}]  {summary}")
        for f in dataclasses.fields(cls):
            if not f.init or f.name.startswith("_"):
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = "(required)"
            shown = "none" if default is None else (default if default == "(required)"
                                                    else _toml_value(default))
            lines.append(f"  {name}.{f.name} = {shown}" + (f"    {docs[f.name]}"
                                                           if f.name in docs else ""))
        lines.append("")
    return "\n".join(lines)


def parse_overrides(argv: Sequence[str]) -> dict:
    """["--model.hidden_size", "64", "--training.train_iters=5"] -> {"model": {"hidden_size": 64}, ...}."""
    out: dict = {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"override {arg!r} must look like --section.key value")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
        else:
            if not args:
                raise ConfigError(f"override {arg} has no value")
            key, text = arg[2:], args.pop(0)
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = _parse_cli_value(text)
    return out


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read the TOML file (if any), apply dotted overrides, build and type-check every section."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from e
    for section, values in parse_overrides(overrides).items():
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"[{section}] must be a table")
        raw[section].update(values)
    return TrainConfig.from_dict(raw)
