"""Appendix B.5's checks and file plumbing: config.json rules, the checkpoint's inventory,
the safetensors reader and the tokenizer files. The page (chapters/model/hf.py) keeps the
name and layout mapping; the messages here name the tensor or key at fault.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from tinytron.model.config import ModelConfig

_HF_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size")


def read_config_json(folder: Path) -> dict:
    """The parsed config.json of a checkpoint folder; ValueError when absent or not JSON."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder / 'config.json'} not found")
    try:
        return json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{folder / 'config.json'}: not valid JSON ({err})") from None


def check_hf_config(hf: dict) -> None:
    """ValueError naming what a Llama config.json lacks or holds that this model cannot."""
    missing = [k for k in _HF_REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"config.json has no {missing[0]!r} (a Llama config needs "
                         f"{', '.join(_HF_REQUIRED)})")
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type must be 'llama', got {hf.get('model_type')!r}")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise ValueError(f"config.json {key}={hf[key]!r} is not supported (need {ok!r})")
    rope_theta(hf)  # the rotary settings, in either layout: refused here if not plain RoPE
    heads = hf["num_attention_heads"]
    if hf.get("head_dim", hf["hidden_size"] // heads) * heads != hf["hidden_size"]:
        raise ValueError(f"config.json head_dim={hf['head_dim']} != hidden_size / heads")


def rope_theta(hf: dict) -> int:
    """RoPE's base from config.json, in transformers' 4.x or 5.x layout; other rope types refused.

    transformers < 5 writes `rope_theta` at the top level and a scaling as `rope_scaling`
    (`{"rope_type": "llama3", ...}`, or the older `"type"`); transformers >= 5 writes both into
    `rope_parameters` (`{"rope_theta": 500000.0, "rope_type": "default"}`). This model implements
    plain RoPE only (rope type "default"), so any other type is a ValueError, as is a base that
    the two layouts give differently, or one that is not a whole number (`rotary_base` is an
    int, Megatron's `--rotary-base` too).
    """
    thetas, types = {}, {}
    if "rope_theta" in hf:
        thetas["rope_theta"] = hf["rope_theta"]
    for key in ("rope_parameters", "rope_scaling"):
        block = hf.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ValueError(f"config.json {key}={block!r} is not a JSON object")
        if "rope_theta" in block:
            thetas[f"{key}.rope_theta"] = block["rope_theta"]
        kind = block.get("rope_type", block.get("type", "default"))
        types[f"{key}.rope_type"] = kind
    for where, kind in types.items():
        if kind != "default":
            raise ValueError(f"config.json {where}={kind!r} is not supported: this model "
                             "implements plain RoPE only (rope type 'default'), so a scaled "
                             "RoPE such as Llama-3.1's 'llama3' would give other logits")
    values = {float(v) for v in thetas.values()}
    if len(values) > 1:
        raise ValueError("config.json gives RoPE's base twice, differently: " + ", ".join(
            f"{k}={v!r}" for k, v in thetas.items()))
    theta = values.pop() if values else 10000.0
    if theta != int(theta) or theta <= 0:
        raise ValueError(f"config.json rope_theta={theta!r} is not supported (a positive whole "
                         "number: the model's rotary_base)")
    return int(theta)


def fetch(read, hf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One checked tensor from the checkpoint: present, right shape, finite."""
    t = read(hf_name)
    if t is None:
        raise ValueError(f"checkpoint is missing tensor {hf_name!r}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {hf_name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise ValueError(f"tensor {hf_name!r} holds NaN or inf")
    return t


def expected_hf_shapes(config: ModelConfig, layer_shapes: Callable[[ModelConfig, int], dict]
                       ) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this config holds, with its shape."""
    h, v = config.hidden_size, config.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config.num_layers):
        shapes.update(layer_shapes(config, layer))
    return shapes


def check_checkpoint(config: ModelConfig, expected: dict, names: set[str], read) -> None:
    """ValueError naming the first missing, unexpected, misshapen or inconsistent tensor."""
    for name, shape in expected.items():
        if name not in names:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        if tuple(read(name, shape_only=True)) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(read(name, shape_only=True))}, "
                             f"expected {shape}")
    extra = sorted(n for n in names - set(expected) if not n.endswith("rotary_emb.inv_freq")
                   and n != "lm_head.weight")
    if extra:
        raise ValueError(f"checkpoint has unexpected tensor {extra[0]!r} ({len(extra)} in all)")
    if "lm_head.weight" in names and config.tie_embeddings:
        if not torch.equal(read("lm_head.weight"), read("model.embed_tokens.weight")):
            raise ValueError("tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                             "but config.json says tie_word_embeddings")


class Reader:
    """Name -> tensor over every *.safetensors file of a checkpoint folder."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors file in {folder}")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {n: h for h in self.handles for n in h.keys()}

    def __call__(self, name: str, shape_only: bool = False):
        handle = self.where.get(name)
        if handle is None:
            return None
        if shape_only:
            return handle.get_slice(name).get_shape()
        return handle.get_tensor(name)


def export_tokenizer(out: Path, tokenizer_file, eos_token_id: int | None,
                      config: ModelConfig) -> int | None:
    """Copy tokenizer.json and write tokenizer_config.json; return the EOS id (found or given)."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tokenizer_file))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{tokenizer_file}: not a tokenizers JSON file ({err})") from None
    if eos_token_id is None:
        eos_token_id = next((i for i in map(tok.token_to_id, ("<|endoftext|>", "</s>"))
                             if i is not None), None)
    if tok.get_vocab_size() > config.vocab_size:
        raise ValueError(f"{tokenizer_file}: {tok.get_vocab_size()} ids do not fit the model's "
                         f"vocab_size {config.vocab_size}")
    # tinytron tokenizes with add_special_tokens=False (Megatron's text_to_ids does too): the
    # training data holds no BOS, so the export's tokenizer must not add one either
    probe = [tok.encode("a b", add_special_tokens=add).ids for add in (True, False)]
    if probe[0] == probe[1]:
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")
    else:
        spec = json.loads(Path(tokenizer_file).read_text(encoding="utf-8"))
        spec["post_processor"] = None  # the part that adds <s> (and any other special token)
        (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False),
                                            encoding="utf-8")
    extra = {"tokenizer_class": "PreTrainedTokenizerFast",
             "model_max_length": config.max_position_embeddings or config.seq_length,
             "add_bos_token": False, "add_eos_token": False}
    if eos_token_id is not None:
        extra["eos_token"] = tok.id_to_token(int(eos_token_id))
    pad = next((t for t in ("<|pad|>", "<pad>") if tok.token_to_id(t) is not None), None)
    if pad is not None:
        extra["pad_token"] = pad
    (out / "tokenizer_config.json").write_text(json.dumps(extra, indent=2) + "\n")
    return eos_token_id
