"""The tokenizer an exported checkpoint travels with: the run's own, found beside the checkpoint.

A training run writes its resolved config to `<save>/config.toml`; its `[tokenizer]` says which
tokenizer made the data: a Hugging Face `tokenizer.json` (copied into the export), or chapter
00's byte tokenizer, which has no file. For that one a `tokenizers` JSON is built here that
gives exactly the byte tokenizer's ids: a byte-level BPE without merges whose 256 base symbols
are the bytes in order (GPT-2's printable stand-ins for the bytes, so any UTF-8 text encodes),
plus the six specials at 256..261 (EOD, pad, the three chat roles, end of turn).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Optional

__all__ = ["byte_symbols", "write_byte_tokenizer", "run_tokenizer", "run_special_tokens",
           "write_run_config"]

BYTE_SPECIALS = ("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


def byte_symbols() -> list[str]:
    """The printable character that stands for each byte 0..255 in a byte-level vocabulary.

    Bytes that are visible Latin-1 characters ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for
    themselves; the other 68 (controls, space, soft hyphen) take U+0100 onwards, in byte order.
    """
    visible = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in visible:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def write_byte_tokenizer(path) -> str:
    """A tokenizer.json whose ids are the byte tokenizer's (bytes 0..255, specials 256..261)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {sym: i for i, sym in enumerate(byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in BYTE_SPECIALS])
    tok.save(str(path))
    return str(path)


def _checkpoint_root(src: Path) -> Path:
    """The run directory of a checkpoint root or of one of its iter_* directories."""
    return src.parent if src.name.startswith("iter_") or src.name == "release" else src


def _run_tokenizer_section(src) -> Optional[dict]:
    """The [tokenizer] table of the run's config.toml beside `src`; None without a config."""
    config = _checkpoint_root(Path(src)) / "config.toml"
    if not config.is_file():
        return None
    try:
        return tomllib.loads(config.read_text()).get("tokenizer", {})
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{config}: not valid TOML ({e})") from None


def run_tokenizer(src) -> tuple[Optional[str], Optional[str]]:
    """(kind, tokenizer file) from the run's config.toml beside `src`; (None, None) without one."""
    section = _run_tokenizer_section(src)
    if section is None:
        return None, None
    kind = section.get("tokenizer_type", "byte")
    if kind == "hf":
        file = section.get("tokenizer_model")
        if not file or not Path(file).is_file():
            config = _checkpoint_root(Path(src)) / "config.toml"
            raise ValueError(f"{config}: [tokenizer] tokenizer_model {file!r} is not a file here "
                             "(pass --tokenizer-file)")
        return kind, str(file)
    return kind, None


def run_special_tokens(src) -> tuple[Optional[str], Optional[str]]:
    """(eod_token, pad_token) the run's [tokenizer] names; None where it names none."""
    section = _run_tokenizer_section(src) or {}
    return section.get("eod_token"), section.get("pad_token")


def _toml(value) -> str:
    """A TOML value for a ModelConfig field (str, bool, int, float, list of str)."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # numbers, strings and string lists read back the same in TOML


def write_run_config(src, dst, model_config) -> Optional[str]:
    """`<dst>/config.toml`: [model] of the imported checkpoint and, when the Hugging Face folder
    has one, [tokenizer] for its tokenizer.json (copied beside the checkpoint) with its EOS as
    the end-of-document token. A fine-tune passes it as `--config`; `to-hf` reads its
    [tokenizer]."""
    import dataclasses
    import json
    import shutil

    lines = ["[model]"] + [f"{k} = {_toml(v)}" for k, v in dataclasses.asdict(model_config).items()
                           if v is not None]
    tokenizer = Path(src) / "tokenizer.json"
    copied = None
    if tokenizer.is_file():
        copied = Path(dst) / "tokenizer.json"
        shutil.copyfile(tokenizer, copied)
        lines += ["", "[tokenizer]", 'tokenizer_type = "hf"',
                  f"tokenizer_model = {json.dumps(str(copied.resolve()))}"]
        eos = _special_token(Path(src) / "tokenizer_config.json", "eos_token")
        if eos:
            lines.append(f"eod_token = {json.dumps(eos)}")
    (Path(dst) / "config.toml").write_text("\n".join(lines) + "\n")
    return str(copied) if copied else None


def _special_token(path: Path, key: str) -> Optional[str]:
    """A special token named in tokenizer_config.json (a string or an AddedToken dict)."""
    import json

    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get(key)
    except ValueError:
        return None
    return value.get("content") if isinstance(value, dict) else value
