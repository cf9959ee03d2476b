# %% [markdown]
# # B.5 · Model: Hugging Face Llama import and export
#
# Load a Hugging Face Llama checkpoint (`config.json` + `model.safetensors`) into this book's
# model — split over TP ranks and pipeline stages when given a grid — and write the model back
# in the same layout, gathering the shards. Export → import is bit-identical, and the imported
# model's logits equal those of `transformers.LlamaForCausalLM` on the same weights.
#
# You will build: `hf_config_dict`, `config_from_hf`, `to_hf_tensors`, `load_hf_llama`,
# `save_hf_llama`.

# %%
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tinytron.model._hf_io import Reader as _Reader
from tinytron.model._hf_io import (check_checkpoint, check_hf_config, expected_hf_shapes,
                                   read_config_json, rope_theta)
from tinytron.model._hf_io import export_tokenizer as _export_tokenizer
from tinytron.model._hf_io import fetch as _fetch
from tinytron.model.config import ModelConfig
from tinytron.model.gpt import GPTModel, build_stage_models, global_parameter_name
from tinytron.model.layers import shard_of, unshard
from tinytron.parallel import ParallelGrid

__all__ = ["hf_config_dict", "config_from_hf", "to_hf_tensors", "from_hf_tensor",
           "load_hf_llama", "save_hf_llama", "gather_full_state"]

# %% [markdown]
# ## Two names for the same weights
#
# | this book (Megatron names) | Hugging Face Llama |
# |---|---|
# | `embedding.word_embeddings.weight` | `model.embed_tokens.weight` |
# | `decoder.layers.{i}.input_layernorm.weight` | `model.layers.{i}.input_layernorm.weight` |
# | `decoder.layers.{i}.self_attention.linear_qkv.weight` | `…self_attn.q_proj`, `k_proj`, `v_proj` |
# | `decoder.layers.{i}.self_attention.linear_proj.weight` | `…self_attn.o_proj.weight` |
# | `decoder.layers.{i}.pre_mlp_layernorm.weight` | `…post_attention_layernorm.weight` |
# | `decoder.layers.{i}.mlp.linear_fc1.weight` | `…mlp.gate_proj`, `up_proj` |
# | `decoder.layers.{i}.mlp.linear_fc2.weight` | `…mlp.down_proj.weight` |
# | `decoder.final_layernorm.weight` | `model.norm.weight` |
# | `output_layer.weight` | `lm_head.weight` (absent when tied) |
#
# Two of them are not one-to-one. `linear_qkv` is fused and grouped by key/value group
# ([page B.3](transformer_layer.py)): with $a/g$ query heads per group its rows are
# $[q_{0} \dots q_{a/g-1}, k_0, v_0, \; q_{a/g} \dots, k_1, v_1, \dots]$ (each $d$ rows), while
# Hugging Face keeps three matrices. Hugging Face's query head $j$ reads key/value head
# $j \,/\, (a/g)$ (`repeat_kv` in `modeling_llama.py`), the same grouping, so the conversion is
# a pure reshuffle of rows: view the fused matrix as $[g, a/g + 2, d, h]$ and slice.
# `linear_fc1` is `gate_proj` stacked on `up_proj`. For $a = 4$ heads in $g = 2$ groups:
#
# ```mermaid
# flowchart LR
#   subgraph tt["this book: decoder.layers.i"]
#     QKV["self_attention.linear_qkv<br/>rows: q0 q1 k0 v0 | q2 q3 k1 v1"]
#     FC1["mlp.linear_fc1<br/>rows: gate | up"]
#     P["self_attention.linear_proj"]
#     FC2["mlp.linear_fc2"]
#     N1["input_layernorm"]
#     N2["pre_mlp_layernorm"]
#   end
#   subgraph hf["Hugging Face: model.layers.i"]
#     Q["self_attn.q_proj<br/>q0 q1 q2 q3"]
#     K["self_attn.k_proj<br/>k0 k1"]
#     V["self_attn.v_proj<br/>v0 v1"]
#     G["mlp.gate_proj"]
#     U["mlp.up_proj"]
#     O["self_attn.o_proj"]
#     D["mlp.down_proj"]
#     H1["input_layernorm"]
#     H2["post_attention_layernorm"]
#   end
#   QKV --> Q
#   QKV --> K
#   QKV --> V
#   FC1 --> G
#   FC1 --> U
#   P --> O
#   FC2 --> D
#   N1 --> H1
#   N2 --> H2
# ```
#
# **RoPE needs no permutation.** Hugging Face's Llama uses rotate-half (pairs $i$ and
# $i + d/2$), and so does this model ([page B.2](layers.py)); Meta's original checkpoints pair adjacent
# channels, and the Meta → HF conversion script permutes the q/k rows once. Megatron's own
# Hugging Face loader does the same q/k/v regrouping as here
# (`tools/checkpoint/loader_mixtral_hf.py:77-98`, `set_attn_state`), with the HF names listed in
# `tools/checkpoint/schema_hf.py:25`.
#
# **RoPE's base lives in two places.** transformers 4.x writes `rope_theta` at the top of
# `config.json` and a scaled RoPE as `rope_scaling`; transformers 5 writes both into one
# `rope_parameters` object (`{"rope_type": "default", "rope_theta": 500000.0}`). Reading only the
# first layout imports a Llama-3 (base 500000) with the default 10000, and the logits of every
# position past the first differ. `config_from_hf` reads both; the export writes both, so either
# transformers reads it back. This model implements plain RoPE only, so any other rope type in
# either place (Llama-3.1's `llama3` scaling, `linear`, `yarn`) is refused by name rather than
# imported as a model that computes something else.
#
# **Shards.** Export gathers each weight's TP pieces (`unshard` with the parameter's
# `ShardSpec`) and the pipeline stages' tensors to the first rank, which writes one file.
# Import reads the file on every rank and keeps its own shard (`shard_of`): the full tensors of
# one layer at a time pass through memory, never the whole model at once on top of the shards.
# Every `*.safetensors` file of the folder is read, so the multi-file checkpoints Hugging Face
# publishes for large models (`model-00001-of-00004.safetensors`, …) load as they are.

# %%
_LAYER_RE = r"decoder\.layers\.(\d+)\.(.+)"
_HF_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def hf_config_dict(config: ModelConfig) -> dict:
    """The config.json of a Hugging Face LlamaForCausalLM with this shape."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.head_dim,
        "vocab_size": config.vocab_size, "max_position_embeddings": config.max_position_embeddings or config.seq_length,
        "rms_norm_eps": config.norm_epsilon, "rope_theta": float(config.rotary_base),
        # transformers >= 5 reads RoPE from here, < 5 from rope_theta above: both say the same
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rotary_base)},
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": config.init_std, "torch_dtype": "float32",
    }


# %% [markdown]
# The way back reads a Hugging Face config.json into a `ModelConfig`, after refusing what this
# model cannot be (biases, other activations or RoPE scalings).

# %%
def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """A ModelConfig from a Hugging Face Llama config.json dict; unsupported features raise."""
    check_hf_config(hf)
    heads = hf["num_attention_heads"]
    fields = dict(hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                  num_attention_heads=heads,
                  num_query_groups=hf.get("num_key_value_heads") or heads,
                  ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                  seq_length=hf.get("max_position_embeddings", 4096),
                  norm_epsilon=hf.get("rms_norm_eps", 1e-6),
                  rotary_base=rope_theta(hf),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  init_std=hf.get("initializer_range", 0.02))
    fields.update(overrides)
    return ModelConfig(**fields)


# %% [markdown]
# ## Full tensors ↔ Hugging Face tensors
#
# Both directions work on *full* (unsharded) tensors by global name; the sharding lives in
# `shard_of` / `unshard`. `to_hf_tensors` maps one full tensor to its one, two or three Hugging
# Face tensors; `from_hf_tensor` builds one full tensor from a reader of Hugging Face tensors
# and checks every shape on the way, naming the tensor that does not fit.

# %%
def _qkv_view(config: ModelConfig, t: torch.Tensor) -> torch.Tensor:
    """The fused QKV weight as [g, a/g + 2, d, h]."""
    g, d = config.num_query_groups, config.head_dim
    return t.view(g, config.num_attention_heads // g + 2, d, config.hidden_size)


def to_hf_tensors(config: ModelConfig, name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hugging Face tensors for one full tensor of this model (by global name)."""
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": full}
    if name == "output_layer.weight":
        return {} if config.tie_embeddings else {"lm_head.weight": full}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    layer, rest = _split_layer(name)
    pre = f"model.layers.{layer}."
    if rest == "self_attention.linear_qkv.weight":
        v4, h = _qkv_view(config, full), config.hidden_size
        per = config.num_attention_heads // config.num_query_groups
        return {pre + "self_attn.q_proj.weight": v4[:, :per].reshape(-1, h),
                pre + "self_attn.k_proj.weight": v4[:, per].reshape(-1, h),
                pre + "self_attn.v_proj.weight": v4[:, per + 1].reshape(-1, h)}
    if rest == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return {pre + "mlp.gate_proj.weight": gate, pre + "mlp.up_proj.weight": up}
    return {pre + _HF_SIMPLE[rest]: full}


# %% [markdown]
# The other direction checks more: every Hugging Face tensor it reads must have the shape this
# config expects, and a wrong one is named.

# %%
def _split_layer(name: str) -> tuple[int, str]:
    import re

    m = re.fullmatch(_LAYER_RE, name)
    if m is None or (m.group(2) not in _HF_SIMPLE and m.group(2) not in (
            "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight")):
        raise ValueError(f"no Hugging Face name for parameter {name!r}")
    return int(m.group(1)), m.group(2)


def _expected_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the Hugging Face tensors of one layer."""
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.head_dim
    a, g, pre = config.num_attention_heads, config.num_query_groups, f"model.layers.{layer}."
    return {pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (a * d, h), pre + "self_attn.k_proj.weight": (g * d, h),
            pre + "self_attn.v_proj.weight": (g * d, h), pre + "self_attn.o_proj.weight": (h, a * d),
            pre + "mlp.gate_proj.weight": (f, h), pre + "mlp.up_proj.weight": (f, h),
            pre + "mlp.down_proj.weight": (h, f)}


# %% [markdown]
# With those two, `from_hf_tensor` builds each full tensor of this model from the checkpoint: the
# embedding, the output layer and the final norm by name, the fused QKV and fc1 by concatenating
# the Hugging Face pieces group by group.

# %%
def from_hf_tensor(config: ModelConfig, name: str, read) -> torch.Tensor:
    """The full tensor of this model's parameter `name`, built from checkpoint reader `read`."""
    h, v = config.hidden_size, config.vocab_size
    if name == "embedding.word_embeddings.weight" or (
            name == "output_layer.weight" and config.tie_embeddings):
        return _fetch(read, "model.embed_tokens.weight", (v, h))
    if name == "output_layer.weight":
        return _fetch(read, "lm_head.weight", (v, h))
    if name == "decoder.final_layernorm.weight":
        return _fetch(read, "model.norm.weight", (h,))
    layer, rest = _split_layer(name)
    shapes, pre = _expected_shapes(config, layer), f"model.layers.{layer}."
    get = lambda n: _fetch(read, pre + n, shapes[pre + n])  # noqa: E731
    if rest == "self_attention.linear_qkv.weight":
        g, d = config.num_query_groups, config.head_dim
        per = config.num_attention_heads // g
        q = get("self_attn.q_proj.weight").view(g, per, d, h)
        k = get("self_attn.k_proj.weight").view(g, 1, d, h)
        vv = get("self_attn.v_proj.weight").view(g, 1, d, h)
        return torch.cat([q, k, vv], dim=1).reshape(-1, h)
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], dim=0)
    return get(_HF_SIMPLE[rest])


# %% [markdown]
# ## Export and import
#
# `save_hf_llama(model_or_chunks, path)` is called on **every** rank of the model (the
# collectives need everyone): TP pieces are all-gathered inside each stage, the stages'
# tensors are gathered over the pipeline group, and global rank 0 writes `config.json` and
# `model.safetensors`. With tied embeddings the last stage's duplicate is not written (the
# file has no `lm_head.weight`, like a tied Hugging Face checkpoint).
#
# `load_hf_llama(path, grid)` checks the whole file first — every expected tensor present with
# its shape, nothing unexpected (apart from the old `rotary_emb.inv_freq` buffers), a tied
# `lm_head.weight`, if present, equal to the embedding — then builds this rank's stage
# model(s) and copies each parameter's shard in. Keyword overrides change config fields that
# a checkpoint does not carry, e.g. `seq_length=4096, sequence_parallel=True`.
#
# The tiny model of the demo shows the inventory in small numbers: each of its 2 layers has 9
# Hugging Face tensors (two norms, `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
# `up_proj`, `down_proj`) where the model has 6 parameters (the fused `linear_qkv` and
# `linear_fc1` split in three and two), plus `model.embed_tokens.weight` and
# `model.norm.weight`: $2 \cdot 9 + 2 = 20$ tensors, tied. Untied it is 21, with `lm_head.weight`.
#
# The walls of checks and the file plumbing (what `config.json` must say, the inventory and its
# shapes, a tensor read with its shape and finiteness checked, the reader over every
# `*.safetensors` file of a folder, the tokenizer files) live in `tinytron.model._hf_io`, with
# the same messages; this page keeps the mapping and the gathers.

# %%
def _as_list(models) -> list[GPTModel]:
    return list(models) if isinstance(models, (list, tuple)) else [models]


def _tp_pieces(t: torch.Tensor, grid: ParallelGrid) -> list[torch.Tensor]:
    """Every TP rank's copy of t, in TP-rank order."""
    if grid.size("tp") == 1:
        return [t]
    pieces = [torch.empty_like(t) for _ in range(grid.size("tp"))]
    dist.all_gather(pieces, t.contiguous(), group=grid.group("tp"))
    return pieces


@torch.no_grad()
def gather_full_state(models) -> dict[str, torch.Tensor]:
    """Full CPU tensors of this pipeline rank's chunks by global name (TP shards gathered)."""
    state = {}
    for model in _as_list(models):
        for name, p in model.named_parameters():
            full = unshard(_tp_pieces(p.detach(), model.grid), p.shard_spec)
            state[global_parameter_name(name, model.layer_offset)] = full.cpu()
    return state


# %% [markdown]
# Export: every rank hands its chunks' full tensors (gathered over TP) to the first rank, which
# writes `config.json`, one `model.safetensors` and, when given, the tokenizer files: the
# `tokenizer.json` is copied and a `tokenizer_config.json` names its end and pad tokens, so that
# `from_pretrained` gives a usable model. When the tokenizer's post-processor adds special
# tokens (the part that makes a Llama tokenizer prepend `<s>`) the copy leaves it out: tinytron, like Megatron's `text_to_ids`
# (`megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py:262-268`), tokenizes the
# training data without special tokens, and a model is best prompted the way it was trained, so
# `AutoTokenizer.from_pretrained(path)(text).input_ids` gives exactly the ids the data held.
# `max_position_embeddings` is the model's own context (`ModelConfig.max_position_embeddings`),
# not the length a fine-tune trained at.

# %% [markdown]
# The first rank writes the folder from the full tensors: renamed and split into Hugging Face's
# pieces, checked complete, then `config.json` (with the end token when there is a tokenizer)
# and one `model.safetensors`.

# %%
def _write_hf_folder(config: ModelConfig, state: dict, path, tokenizer_file: str | None,
                     eos_token_id: int | None) -> None:
    """config.json + model.safetensors (+ tokenizer files) of the full `state`, on one rank."""
    from safetensors.torch import save_file

    tensors = {}
    for name, full in state.items():
        tensors.update(to_hf_tensors(config, name, full))
    missing = set(expected_hf_shapes(config, _expected_shapes)) - set(tensors)
    assert not missing, f"export lost tensors {sorted(missing)[:3]}"
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_config_dict(config)
    hf["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    if tokenizer_file is not None:
        eos_token_id = _export_tokenizer(out, tokenizer_file, eos_token_id, config)
    if eos_token_id is not None:
        hf["eos_token_id"] = int(eos_token_id)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


# %%
def save_hf_llama(models, path: str | os.PathLike, *, tokenizer_file: str | None = None,
                  eos_token_id: int | None = None) -> None:
    """Write config.json + model.safetensors in Hugging Face Llama layout (call on every rank).

    With `tokenizer_file` (a `tokenizers` JSON, e.g. the `*_tokenizer.json` that
    `tinytron-preprocess --tokenizer-type bpe` writes) the folder also holds `tokenizer.json`,
    and `eos_token_id` (looked up as `<|endoftext|>` when not given) goes into config.json, so
    `AutoTokenizer.from_pretrained(path)` works too.

    Example::

        save_hf_llama(model, "out/hf", tokenizer_file="data/corpus_tokenizer.json")
        model, config = load_hf_llama("out/hf")   # or transformers' from_pretrained("out/hf")
    """
    chunks = _as_list(models)
    grid, config = chunks[0].grid, chunks[0].config
    state = gather_full_state(chunks)
    if grid.size("pp") > 1:
        parts = [None] * grid.size("pp")
        dist.all_gather_object(parts, state, group=grid.group("pp"))
        state = {k: v for part in parts for k, v in part.items()}
    if grid.global_rank == 0:
        _write_hf_folder(config, state, path, tokenizer_file, eos_token_id)
    if dist.is_available() and dist.is_initialized() and grid.world_size > 1:
        dist.barrier()


# %% [markdown]
# Import checks the whole checkpoint before reading a single weight, so a wrong file fails in
# a second with the name of the tensor at fault instead of half-way through a copy. Then each
# rank builds its chunks without drawing an init and fills every parameter with its
# shard of the full tensor read from the files.

# %%
@torch.no_grad()
def load_hf_llama(path: str | os.PathLike, grid: ParallelGrid | None = None, *,
                  num_virtual_stages: int = 1, dtype: torch.dtype | None = None,
                  **config_overrides):
    """(model, config) from a Hugging Face Llama folder; this rank's shard and stage(s) of it.

    Example::

        model, config = load_hf_llama("out/hf")                   # one process, whole model
        chunks, config = load_hf_llama("out/hf", grid, num_virtual_stages=2)  # TP/PP shards
    """
    folder = Path(path)
    config = config_from_hf(read_config_json(folder), **config_overrides)
    read = _Reader(folder)
    check_checkpoint(config, expected_hf_shapes(config, _expected_shapes), set(read.where), read)
    grid = grid if grid is not None else ParallelGrid.single()
    chunks = build_stage_models(config, grid, num_virtual_stages=num_virtual_stages, dtype=dtype,
                                initialize=False)
    for model in chunks:
        for name, p in model.named_parameters():
            full = from_hf_tensor(config, global_parameter_name(name, model.layer_offset), read)
            p.copy_(shard_of(full, p.shard_spec, grid.rank("tp"), grid.size("tp")).to(p.dtype))
    return (chunks[0] if len(chunks) == 1 else chunks), config


# %% [markdown]
# <details><summary>Megatron detail: offline conversion</summary>
#
# <p>Megatron converts offline: its loader builds the whole Hugging Face model with
# <code>transformers</code> (<code>tools/checkpoint/loader_mixtral_hf.py:139</code>) and sends full
# tensors through a queue to a saver that writes Megatron's own checkpoint
# (<code>:283-335</code>). tinytron reads and writes the <code>safetensors</code> files directly,
# without <code>transformers</code>, on every rank of the training layout, and keeps only each
# rank's shard; there is no intermediate checkpoint.</p>
#
# </details>

# %% [markdown]
# ## Demo: a round trip, and a checkpoint that does not fit
#
# The tiny model is exported, the file is listed, the export is imported into a fresh model
# and compared bit for bit; then a checkpoint with one tensor of the wrong shape is refused
# with that tensor's name.

# %%
if __name__ == "__main__":
    import tempfile

    from safetensors.torch import load_file, save_file

    from tinytron.model.config import tiny_config

    config = tiny_config(seed=7)
    model = GPTModel(config)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_llama(model, tmp)
        tensors = load_file(f"{tmp}/model.safetensors")
        for name in list(tensors)[:6]:
            print(f"{name:<45} {tuple(tensors[name].shape)}")
        print(f"... {len(tensors)} tensors; lm_head.weight present: {'lm_head.weight' in tensors}")
        loaded, loaded_config = load_hf_llama(tmp, seq_length=config.seq_length)
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     loaded.state_dict().values()))
        tokens = torch.randint(0, config.vocab_size, (2, 16))
        logits_equal = torch.equal(model(tokens), loaded(tokens))
        print(f"export -> import bit-identical: {same}; logits equal: {logits_equal}")

        tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 64)
        save_file(tensors, f"{tmp}/model.safetensors")
        try:
            load_hf_llama(tmp)
            raise AssertionError("a misshapen tensor must be refused")
        except ValueError as err:
            print("refused:", err)
            message = str(err)

    assert same and logits_equal and loaded_config == config.replace(seed=1234)
    assert "lm_head.weight" not in tensors and "model.layers.1.self_attn.k_proj.weight" in message
    assert len(tensors) == 2 * 9 + 2                  # the inventory worked out above

# %% [markdown]
# ## Summary
#
# - The Megatron-named model and the Hugging Face Llama layout differ by names, by the fused
#   and group-ordered QKV matrix, and by the stacked gate/up matrix — never by RoPE, since both
#   use rotate-half.
# - Export gathers TP shards and pipeline stages and writes one `model.safetensors` from rank 0;
#   import checks the whole file, then every rank keeps only its shard of its stage.
# - Export → import is bit-identical; `tests/test_model_hf.py` also compares the logits with
#   `transformers.LlamaForCausalLM` when `transformers` is installed (`pip install
#   tinytron[hf-parity]`).
#
# ## How production does it
#
# - Megatron: `tools/checkpoint/convert.py` with `loader_mixtral_hf.py` and `saver_core.py`
#   (offline conversion through a queue of full tensors; `docs/llama_mistral.md` explains the
#   Llama route), and Megatron Bridge's HF ↔ Megatron mappings that convert on the fly with
#   TP/PP-aware gathers.
# - torchtitan: `scripts/convert_llama_to_dcp.py` and its `StateDictAdapter` (HF names, with the
#   q/k permutation because its RoPE pairs adjacent channels).
#
# ## Exercises
#
# 1. Write the sharded Hugging Face format (`model-0000k-of-0000n.safetensors` plus
#    `model.safetensors.index.json`) so that no rank ever holds more than one layer in full.
#
#    <details><summary>Hint</summary>
#
#    Today <code>gather_full_state</code> gathers every tensor
#    before <code>_write_hf_folder</code> writes one file. Instead loop over layers: gather one
#    layer's full tensors, convert them with <code>to_hf_tensors</code>, write them as file $k$,
#    free them, and record each tensor's file in the index's <code>weight_map</code>. Import
#    already reads every <code>*.safetensors</code> file of the folder.
#
#    </details>
#
# 2. Load a checkpoint whose vocabulary does not divide by $t$ by padding the embedding rows
#    (`padded_vocab_size`), and strip the padding again on export.
#
#    <details><summary>Hint</summary>
#
#    <code>from_hf_tensor</code> fetches the embedding and
#    <code>lm_head</code> with the shape $(V, h)$: on import, allocate $(V_\text{padded}, h)$,
#    copy the $V$ rows in and leave the padding rows at zero (no token ever selects them), with
#    <code>config_from_hf</code> taking the padded size. On export, <code>to_hf_tensors</code>
#    cuts the rows back to the original $V$, which config.json must keep.
#
#    </details>
#
# 3. Export in bf16 and measure how far the logits move from the fp32 model.
#
#    <details><summary>Hint</summary>
#
#    Build the model with <code>dtype=torch.bfloat16</code> (or
#    cast the state before <code>_write_hf_folder</code>; config.json's <code>torch_dtype</code>
#    follows the tensors), load it back with <code>load_hf_llama</code>, and compare logits on the
#    same batch. Expect the gap of rounding every weight to 8 significant bits, at most $2^{-8}$
#    relative per weight, grown through the layers.
#
#    </details>
