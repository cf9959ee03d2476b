# %% [markdown]
# # 03 · Checkpoint: `tinytron-convert`, to and from Hugging Face
#
# Checkpoints leave training in one of two layouts — a `torch_dist` directory on any TP/PP/DP
# layout, or legacy `mp_rank_*` files — and are used elsewhere as a Hugging Face Llama folder.
# The converter goes through appendix B's `tinytron.model.hf`: read the checkpoint into one
# unsharded `GPTModel` in one process, then export; and back. Megatron-Core's own `torch_dist`
# checkpoints take the same path, since their keys are the ones tinytron writes.
#
# You will build: `read_checkpoint_model`, `checkpoint_to_hf`, `hf_to_checkpoint`, `main`
# (the `tinytron-convert` command).
#
# Every route passes through the same middle: one whole model in one process. What differs is
# how each format gets there — and that is where the code of this page goes.
#
# ```mermaid
# flowchart TB
#   TD["torch_dist directory<br/>any TP x PP x DP"] -->|"load_model_weights<br/>DCP assembles full tensors"| M
#   MC["Megatron torch_dist<br/>args Namespace, no model config"] -->|"infer_config from shapes<br/>+ heads from args (safe load)"| M
#   LG["legacy mp_rank_TT_PPP/<br/>model_optim_rng.pt"] -->|"_legacy_full_state<br/>global layer names + unshard"| M
#   M["one GPTModel<br/>TP 1 x PP 1, full tensors"] -->|"save_hf_llama"| HF["Hugging Face folder<br/>config.json + model.safetensors"]
#   HF -->|"load_hf_llama"| M2["one GPTModel"]
#   M2 -->|"CheckpointManager.save<br/>iteration 0, model only"| CK["tinytron checkpoint<br/>torch_dist or torch"]
# ```

# %%
from __future__ import annotations

import argparse
import pathlib
import pickle
import re
import signal
import types
from pathlib import Path

import torch

from tinytron.checkpoint._convert_cli import check_target, main
from tinytron.checkpoint.formats import (LEGACY_MODEL_FILENAME, detect_format,
                                         resolve_checkpoint_dir)
from tinytron.model import GPTModel, ModelConfig
from tinytron.model.config import stage_layer_ranges
from tinytron.model.gpt import global_parameter_name
from tinytron.model.layers import unshard

__all__ = ["read_checkpoint_model", "checkpoint_to_hf", "hf_to_checkpoint", "infer_config",
           "read_common", "megatron_args_fields", "MegatronObject", "check_target", "main"]

# %% [markdown]
# ## Which model is in the checkpoint?
#
# A tinytron checkpoint carries its `ModelConfig` in `common.pt` (or in each legacy file)
# under `args.model_config`. A Megatron training checkpoint keeps its run's `argparse.Namespace`
# there instead (`state_dict['args'] = args`, `megatron/training/checkpointing.py:1008`), which
# the next section reads safely; a model-only save (`dist_checkpointing.save` of a model's
# sharded state dict) has no config at all. The shapes in DCP's index give most of it back:
#
# | from | gives |
# |---|---|
# | `embedding.word_embeddings.weight` $[V, h]$ | vocabulary, hidden size |
# | `decoder.layers.self_attention.linear_qkv.weight` $[L, (a + 2g)d, h]$ | layers, $(a+2g)d$ |
# | `decoder.layers.mlp.linear_fc1.weight` $[L, 2f, h]$ | FFN size |
# | `output_layer.weight` present or not | tied or untied embeddings |
#
# The head count is not in any shape ($d$ is unknown), so `--num-attention-heads` (and
# `--num-query-groups`, else derived from the QKV rows) must be given; RoPE base and norm
# epsilon default to Megatron's (10000, 1e-5) unless given.
#
# Worked by hand for the tiny GPT of the tests, saved model-only: the index says
# `word_embeddings` is $[512, 64]$, `linear_qkv` is $[2, 128, 64]$ and `linear_fc1` is
# $[2, 256, 64]$, with no `output_layer`. So $V = 512$, $h = 64$, $L = 2$, $f = 256/2 = 128$,
# and the embeddings are tied. Given `--num-attention-heads 4`, the head size is
# $d = 64/4 = 16$, and the 128 QKV rows are $(4 + 2g) \cdot 16$, so $g = (128/16 - 4)/2 = 2$
# query groups; a head count that leaves a remainder (say 3: $d = 21$, and $(3 + 2g) \cdot 21$
# is never 128) is refused with the row count in the message rather than built wrong. Why the
# heads cannot be guessed: 4 heads of 16 and 8 heads of 8 give the same 64 columns, and, with
# the groups free, the same 128 rows (4 + 2·2 = 8 rows of 16; 8 + 2·4 = 16 rows of 8).

# %%
def _metadata_shapes(directory: Path) -> dict:
    """{key: global shape} of a torch_dist directory's tensors."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")}


def infer_config(directory: Path, num_attention_heads: int | None,
                 num_query_groups: int | None = None, **fields) -> ModelConfig:
    """A ModelConfig from the tensor shapes of a torch_dist checkpoint plus the head count."""
    shapes = _metadata_shapes(directory)
    need = ["embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight",
            "decoder.layers.mlp.linear_fc1.weight"]
    missing = [k for k in need if k not in shapes]
    if missing:
        raise ValueError(f"{directory}: no tensor {missing[0]!r}: not a GPT checkpoint with "
                         "stacked layers")
    if num_attention_heads is None:
        raise ValueError(f"{directory} holds no model config: pass --num-attention-heads "
                         "(and --num-query-groups for GQA)")
    v, h = shapes[need[0]]
    layers, rows, _ = shapes[need[1]]
    d = h // num_attention_heads
    groups = num_query_groups or (rows // d - num_attention_heads) // 2
    if (num_attention_heads + 2 * groups) * d != rows:
        raise ValueError(f"{directory}: linear_qkv has {rows} rows, which does not fit "
                         f"{num_attention_heads} heads and {groups} query groups of size {d}")
    return ModelConfig(hidden_size=h, num_layers=layers, num_attention_heads=num_attention_heads,
                       num_query_groups=groups, ffn_hidden_size=shapes[need[2]][1] // 2,
                       vocab_size=v, seq_length=fields.pop("seq_length", 4096),
                       tie_embeddings="output_layer.weight" not in shapes, **fields)


# %% [markdown]
# ## Megatron's `args`, read without running its pickle
#
# A checkpoint is a file from elsewhere, so it is read as data: `torch.load(weights_only=True)`
# rebuilds tensors and plain containers and calls nothing else. Megatron's `args` is an
# `argparse.Namespace` whose values include objects of Megatron's own classes (the attention
# backend is an `AttnBackend` enum member, the CUDA-graph scope another), and Megatron itself
# loads `common.pt` with those classes on PyTorch's allow-list (`megatron/core/safe_globals.py:26-52`).
# Here Megatron is not installed, so each of its classes is allowed *by name* and rebuilt as an
# inert `MegatronObject` that only keeps its arguments: the restricted unpickler still calls
# nothing but what this list names. A class outside the list stops the safe load with an error
# naming it; then either give the heads yourself (`--num-attention-heads`), or opt in to a full
# unpickle with `trust_pickle=True` (`--trust-pickle`), which can run any code the file asks
# for: only for a checkpoint you trust.

# %%
class MegatronObject:
    """An inert stand-in for an object of one of Megatron's classes (its arguments, its state)."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self) -> str:
        return f"MegatronObject{self.args}"


# %% [markdown]
# The allow-list: the few standard classes an `args` holds, and Megatron's own classes by name,
# each rebuilt as a `MegatronObject`. `read_common` loads with it, and names the class when a
# file needs one that is not on it.

# %%
_MEGATRON_CLASSES = [  # megatron/core/safe_globals.py:26-46 at e03878b5f, Megatron's own
    "megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope", "megatron.core.enums.ModelType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState"]
_SAFE_GLOBALS = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals,
                 *[(MegatronObject, name) for name in _MEGATRON_CLASSES]]


def read_common(directory: Path, trust_pickle: bool = False):
    """common.pt of a torch_dist directory (None if absent); a ValueError if it needs pickle."""
    path = Path(directory) / "common.pt"
    if not path.is_file():
        return None
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if trust_pickle:
            return torch.load(path, map_location="cpu", weights_only=False)
        found = re.search(r"GLOBAL (\S+)", str(err))
        raise ValueError(f"{path} holds {found.group(1) if found else 'an object'}, which the safe "
                         "loader does not rebuild: pass --num-attention-heads (and "
                         "--num-query-groups), or --trust-pickle for a checkpoint you trust "
                         "(a full unpickle can run code)") from None


# %% [markdown]
# From a Megatron `args` the converter takes what the shapes cannot say — the head count, the
# query groups (`num_query_groups` counts only with `group_query_attention`), the norm epsilon,
# the RoPE base and the sequence length — and a value given on the command line wins.

# %%
def megatron_args_fields(args) -> dict:
    """ModelConfig fields read from a Megatron args Namespace (what the shapes do not carry)."""
    get = lambda name: getattr(args, name, None)  # noqa: E731 - one lookup, many names
    heads = get("num_attention_heads")
    fields = {"num_attention_heads": heads,
              "num_query_groups": get("num_query_groups") if get("group_query_attention") else heads,
              "norm_epsilon": get("norm_epsilon"), "rotary_base": get("rotary_base"),
              "seq_length": get("seq_length")}
    return {k: v for k, v in fields.items() if v is not None}


# %% [markdown]
# ## Reading any checkpoint into one process
#
# `torch_dist`: build the model at TP 1 × PP 1 and call `load_model_weights` — DCP assembles
# every full tensor from whatever chunks the training layout wrote. Legacy files cannot be
# resharded by the loader, so the converter merges them itself: for each `mp_rank_TT_PPP`
# file it knows the TP rank and the stage, hence the global layer index of each local name
# (`stage_layer_ranges`), and `unshard` with each parameter's `ShardSpec` glues the TP pieces
# back together (the two halves of `linear_fc1` included).

# %%
def _legacy_full_state(directory: Path, config: ModelConfig) -> dict:
    """{global name: full tensor} from every mp_rank_* file of a legacy directory."""
    files = sorted(directory.glob(f"mp_rank_*/{LEGACY_MODEL_FILENAME}"))
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    pp = 1
    for path in files:
        m = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?", path.parent.name)
        tp_rank, pp_rank = int(m.group(1)), int(m.group(2) or 0)
        sd = torch.load(path, map_location="cpu", weights_only=True)
        pp = sd["args"]["pipeline_model_parallel_size"]
        models = [sd["model"]] if "model" in sd else [sd[f"model{i}"] for i in
                                                      range(sum(k.startswith("model") for k in sd))]
        ranges = stage_layer_ranges(config.num_layers, pp, len(models), pp_rank)
        for state, (start, _) in zip(models, ranges):
            for name, t in state.items():
                pieces.setdefault(global_parameter_name(name, start), {})[tp_rank] = t
    specs = {n: p.shard_spec for n, p in GPTModel(config, initialize=False).named_parameters()}
    return {name: unshard([by_rank[r] for r in sorted(by_rank)], specs[name])
            for name, by_rank in pieces.items() if name in specs}


# %% [markdown]
# Which config the model is built with: the checkpoint's own, else the shapes plus Megatron's
# `args`, where a value given on the command line wins.

# %%
def _config_of(directory: Path, fmt: str, heads, groups, trust_pickle=False,
               **fields) -> ModelConfig:
    """The checkpoint's own ModelConfig, else shapes plus Megatron's args (or the flags)."""
    if fmt == "torch":
        first = sorted(directory.glob(f"mp_rank_*/{LEGACY_MODEL_FILENAME}"))[0]
        saved = torch.load(first, map_location="cpu", weights_only=True)["args"]["model_config"]
        return ModelConfig(**saved)
    try:
        common = read_common(directory, trust_pickle)
    except ValueError:
        if heads is None:
            raise
        common = None  # the heads are given: Megatron's args are not needed
    args = common.get("args") if isinstance(common, dict) else None
    if isinstance(args, dict) and args.get("model_config") is not None:
        return ModelConfig(**args["model_config"])  # tinytron's own
    given = {"num_attention_heads": heads, "num_query_groups": groups, **fields}
    merged = {**(megatron_args_fields(args) if args is not None else {}),
              **{k: v for k, v in given.items() if v is not None}}
    return infer_config(directory, merged.pop("num_attention_heads", None),
                        merged.pop("num_query_groups", None), **merged)


# %%
def read_checkpoint_model(path, num_attention_heads: int | None = None,
                          num_query_groups: int | None = None, trust_pickle: bool = False,
                          **fields) -> GPTModel:
    """The whole model (TP 1, PP 1) from a checkpoint root or iteration directory, either format."""
    from tinytron.checkpoint.torch_dist import _model_dir, load_model_weights

    directory = _model_dir(Path(path))
    fmt = detect_format(directory)
    config = _config_of(directory, fmt, num_attention_heads, num_query_groups, trust_pickle,
                        **fields)
    model = GPTModel(config, initialize=False)
    if fmt == "torch_dist":
        load_model_weights(directory, model)
        return model
    full = _legacy_full_state(directory, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in full:
                raise ValueError(f"{directory}: no legacy tensor for {name!r}")
            p.copy_(full[name])
    return model


# %% [markdown]
# ## Both directions, and the command
#
# `checkpoint_to_hf(src, dst)` = `read_checkpoint_model` + appendix B's `save_hf_llama`.
# `hf_to_checkpoint(src, dst)` = `load_hf_llama` + a tinytron checkpoint at iteration 0
# (model only, no optimizer: a fine-tuning run starts from it with fresh optimizer state, and
# the fp32 masters are derived from the weights). Both run in one process: the full model
# passes through memory once, which is what an offline converter does anyway.
#
# ```
# tinytron-convert to-hf   CHECKPOINT HF_DIR [--num-attention-heads A --num-query-groups G] [--trust-pickle]
# tinytron-convert from-hf HF_DIR CHECKPOINT_ROOT [--format torch_dist|torch] [--force]
# ```
#
# `from-hf` writes a tracker at iteration 0, so pointed at a training run's directory it would
# turn that run's next resume into a restart from the converted weights. It refuses any
# directory that is not empty (one line naming the tracker's iteration when there is one)
# unless `--force` says that is intended.
#
# <details><summary>Megatron detail: no such check</summary>
#
# Megatron's converter has no such check: its saver
# opens the target with `os.makedirs(save_dir, exist_ok=True)` and writes into it
# (`tools/checkpoint/dist_checkpoint_io.py:238`).
#
# </details>

# %% [markdown]
# An export is usable only with its tokenizer: `AutoTokenizer.from_pretrained` on the folder
# must give the ids the model was trained on. The run's `config.toml`, beside the checkpoint,
# names it (`[tokenizer]`): a Hugging Face `tokenizer.json` is copied; for chapter 00's byte
# tokenizer, which has no file, the converter writes one that gives the same ids (a byte-level
# BPE without merges, bytes 0-255 in order, the six specials after them). `--tokenizer-file`
# names one explicitly; a checkpoint without a run config (Megatron's) gets none unless named.

# %%
def checkpoint_to_hf(src, dst, tokenizer_file: str | None = None, **kwargs) -> ModelConfig:
    """Convert a checkpoint (either format, any layout) to a Hugging Face Llama folder,
    with the run's tokenizer (or `tokenizer_file`) when it is known."""
    import tempfile

    from tinytron.checkpoint._hf_tokenizer import (run_special_tokens, run_tokenizer,
                                                   write_byte_tokenizer)
    from tinytron.model.hf import save_hf_llama

    model = read_checkpoint_model(src, **kwargs)
    kind, found = (None, tokenizer_file) if tokenizer_file else run_tokenizer(src)
    with tempfile.TemporaryDirectory() as tmp:
        eos = None
        if kind == "byte":
            found, eos = write_byte_tokenizer(Path(tmp) / "tokenizer.json"), 256
        elif found is not None:  # the end-of-document token the run trained with ([tokenizer])
            eos = _token_id(found, run_special_tokens(src)[0])
        save_hf_llama(model, dst, tokenizer_file=found, eos_token_id=eos)
    return model.config


# %% [markdown]
# The end-of-document id of a tokenizer file, looked up by its token.

# %%
def _token_id(tokenizer_file, token):
    """The id of `token` in a tokenizers JSON file (None for no token, or one it lacks)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file)).token_to_id(token) if token else None


# %% [markdown]
# The other direction: load the Hugging Face folder into a tinytron model, save it at iteration
# 0 without RNG states, and write the run config a fine-tune reads.

# %%
def hf_to_checkpoint(src, dst, ckpt_format: str = "torch_dist") -> ModelConfig:
    """Convert a Hugging Face Llama folder to a tinytron checkpoint root at iteration 0."""
    from tinytron.checkpoint.resume import CheckpointConfig, CheckpointManager, _train_state_class
    from tinytron.model.hf import load_hf_llama

    model, config = load_hf_llama(src)
    manager = CheckpointManager(CheckpointConfig(save=str(dst), ckpt_format=ckpt_format,
                                                 no_save_rng=True), model.grid)
    manager.save(_train_state_class()(), model)
    from tinytron.checkpoint._hf_tokenizer import write_run_config
    write_run_config(src, dst, config)  # [model] and [tokenizer] for the fine-tune's --config
    return config


# %% [markdown]
# ### The command line, and the refusal
#
# The flags, `check_target` and `main` live in `tinytron.checkpoint._convert_cli`, from which
# this page imports `main` and `check_target`. What the check decides, for a `from-hf` target:
#
# | the target | `from-hf` does |
# |---|---|
# | does not exist, or an empty directory | writes iteration 0 there |
# | holds `latest_checkpointed_iteration.txt` saying 1200 | stops: a resume there would lose 1200 iterations |
# | holds any other file | stops: the directory belongs to something else |
# | a file, not a directory | stops |
# | anything, with `--force` | writes, rewriting the tracker to 0 |
#
# Why refuse rather than warn: the damage is silent and shows up later. The converter itself
# succeeds; only the next `tinytron-train` in that directory, which reads the tracker to
# decide where to resume (Megatron's tracker, named at `megatron/training/checkpointing.py:312-316`
# and read by `read_metadata` at `:326`), starts again from the converted weights at
# iteration 0. Every refusal, and every other bad
# input (a missing directory, a checkpoint without heads), is one `tinytron-convert: error:`
# line with exit status 2, so a script can tell a refused request from a crash.

# %% [markdown]
# ## Demo: a PP 2 training checkpoint → Hugging Face → checkpoint
#
# Two ranks save the tiny GPT (4 layers, tied embeddings) in both formats as two pipeline
# stages (the tests do the same at TP 2 × PP 2). The
# converter turns each into a Hugging Face folder in this one process; both folders hold
# exactly the tensors of the one-process model with the same seed. Then the Hugging Face folder
# goes back to a `torch_dist` checkpoint, which `load_model_weights` reads bit-identically. A
# Megatron-Core checkpoint takes the same route (tested in `tests/test_checkpoint_megatron.py`).

# %%
if __name__ == "__main__":
    import tempfile

    from safetensors.torch import load_file

    from tinytron.checkpoint import _workers
    from tinytron.checkpoint.torch_dist import load_model_weights
    from tinytron.launch import run_on_ranks
    from tinytron.model import tiny_config
    from tinytron.model.hf import gather_full_state, to_hf_tensors

    config = tiny_config(num_layers=4, seed=11)
    expected = {}
    for name, full in gather_full_state(GPTModel(config)).items():
        expected.update(to_hf_tensors(config, name, full))
    with tempfile.TemporaryDirectory() as tmp:
        run_on_ranks(_workers.save_both_formats, 2, tmp, config, 1, 2, timeout=300)
        same = {}
        for fmt in ("torch_dist", "torch"):
            assert main(["to-hf", f"{tmp}/{fmt}", f"{tmp}/hf_{fmt}"]) == 0
            got = load_file(f"{tmp}/hf_{fmt}/model.safetensors")
            same[fmt] = got.keys() == expected.keys() and all(torch.equal(got[k], expected[k])
                                                                for k in expected)
        print("HF export equals the one-process model:", same)
        assert main(["from-hf", f"{tmp}/hf_torch_dist", f"{tmp}/back"]) == 0
        back = GPTModel(config.replace(seed=1), initialize=False)
        load_model_weights(f"{tmp}/back", back)
        roundtrip = all(torch.equal(p, q) for p, q in zip(back.parameters(),
                                                           GPTModel(config).parameters()))
        print("HF -> torch_dist -> model bit-identical:", roundtrip)
        status = main(["to-hf", f"{tmp}/nowhere", f"{tmp}/x"])
    assert all(same.values()) and roundtrip and status == 2

# %% [markdown]
# ## Summary
#
# - `tinytron-convert to-hf` reads any tinytron checkpoint (either format, any layout) or a
#   Megatron-Core `torch_dist` checkpoint into one unsharded model and writes a Hugging Face
#   Llama folder with appendix B's exporter; `from-hf` goes back to a `torch_dist` (or legacy)
#   checkpoint at iteration 0.
# - `torch_dist` needs no merging code — DCP assembles full tensors from any layout; the legacy
#   format needs the TP pieces unsharded and the stages' local layer numbers made global.
#
# ## How production does it
#
# - Megatron: `tools/checkpoint/convert.py` with loaders/savers per format
#   (`loader_core.py`, `saver_core.py`, `loader_mixtral_hf.py`, `schema_hf.py`), which pass
#   full tensors through a queue between a loader and a saver process; Megatron Bridge converts
#   Hugging Face ↔ Megatron on the fly.
# - torchtitan: `scripts/convert_llama_to_dcp.py` and the `StateDictAdapter` of each model.
#
# ## Exercises
#
# 1. Extend `read_checkpoint_model` to a Megatron legacy checkpoint, whose `args` is a
#    Namespace: which of its fields give the `ModelConfig`?
#
#    <details><summary>Hint</summary>
#
#    Start from `megatron_args_fields`, which already reads the
#    heads, the query groups, the norm epsilon, the RoPE base and the sequence length from an
#    `args` Namespace. The rest (hidden size, layers, vocabulary, FFN size) can come from the
#    tensor shapes, as for `torch_dist`.
#
#    </details>
#
# 2. A 70B model does not fit in one process. Which part of the converter would you make
#    layer-by-layer, and what does DCP's partial load (asking for one layer's boxes) give you?
#
#    <details><summary>Hint</summary>
#
#    `read_checkpoint_model` builds the whole model before
#    `save_hf_llama` writes it. A stacked key $[L, \dots]$ can be read one layer at a time by
#    asking for the box at offset $(i, 0, \dots)$ of size $(1, \dots)$, as `TensorLayout.boxes`
#    does; think about writing the Hugging Face shards layer by layer too.
#
#    </details>

