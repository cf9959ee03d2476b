"""Text out of a trained model: sampling with a KV cache over appendix B's GPTModel.

    python -m tinytron.model._generate runs/tiny --prompt "def main(" --max-new-tokens 200

The checkpoint is read by chapter 03's converter (either format, any TP/PP layout) into one
whole model in this process; the tokenizer is the run's `[tokenizer]` (from the `config.toml`
beside the checkpoint) or `--tokenizer-file`.

Decoding runs the prompt once through every layer, keeping each layer's keys and values (after
RoPE) in a cache of `[b, g, max_len, d]`; each new token then costs one position per layer: its
query attends to the cached keys, its own key and value are written at the next slot. This is
the model's own forward, step for step (the same modules, weights, RoPE tables and grouped
attention), only with the keys and values of earlier positions kept instead of recomputed.
Greedy decoding (`temperature=0`) equals `transformers`' greedy decoding of the exported model.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from tinytron.model.layers import rope_cos_sin

__all__ = ["KVCache", "generate", "sample_next", "parser", "main"]


class KVCache:
    """Per layer: keys and values [b, g, max_len, d] of the positions decoded so far."""

    def __init__(self, num_layers: int, batch: int, groups: int, max_len: int, head_dim: int,
                 dtype, device):
        shape = (batch, groups, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length, self.max_len = 0, max_len


def _check(model) -> None:
    grid = model.grid
    if (grid.size("tp"), grid.size("pp"), grid.size("cp")) != (1, 1, 1) or not (
            model.pre_process and model.post_process):
        raise ValueError("generate needs the whole model in one process (tp = pp = cp = 1): "
                         "read it with tinytron.checkpoint.convert.read_checkpoint_model")
    if model.config.sequence_parallel:
        raise ValueError("generate needs sequence_parallel off")


def _layer(layer, x, cos, sin, cache: KVCache, index: int, start: int):
    """One decoder layer over positions start..start+s-1, reading and extending the cache."""
    att = layer.self_attention
    q, k, v = att.project_qkv(layer.input_layernorm(x), cos, sin)   # as the training forward
    end = start + x.shape[0]
    cache.k[index][:, :, start:end] = k.permute(1, 2, 0, 3)
    cache.v[index][:, :, start:end] = v.permute(1, 2, 0, 3)
    keys, values = cache.k[index][:, :, :end], cache.v[index][:, :, :end]
    q_pos = torch.arange(start, end, device=x.device)
    allowed = torch.arange(end, device=x.device)[None, :] <= q_pos[:, None]   # causal [s, end]
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), keys, values, attn_mask=allowed,
                                         enable_gqa=True)
    x = x + att.linear_proj(out.permute(2, 0, 1, 3).flatten(2))
    return x + layer.mlp(layer.pre_mlp_layernorm(x))


@torch.no_grad()
def forward_with_cache(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [b, V] of the last of `tokens` [b, s], which follow the cache's positions."""
    start, s = cache.length, tokens.shape[1]
    if start + s > cache.max_len:
        raise ValueError(f"{start + s} positions exceed the cache's {cache.max_len}")
    x = model.embedding.word_embeddings(tokens).transpose(0, 1)    # [s, b, h]
    positions = torch.arange(start, start + s, device=tokens.device)
    cos, sin = rope_cos_sin(positions, model.config.head_dim, model.config.rotary_base,
                            x.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                  # [s, 1, d]
    for i, layer in enumerate(model.decoder.layers):
        x = _layer(layer, x, cos, sin, cache, i, start)
    cache.length = start + s
    last = model.decoder.final_layernorm(x[-1])                     # [b, h]
    return F.linear(last, model.output_weight()).float()


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next ids [b] from logits [b, V]: argmax at temperature 0, else top-k / top-p sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p        # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, eod: Optional[int] = None, seed: int = 0,
             use_cache: bool = True, vocab_size: Optional[int] = None) -> list[int]:
    """The prompt's continuation (new ids only), stopping at `eod` or after max_new_tokens.

    `vocab_size` (the tokenizer's) keeps the padding rows of the embedding table from being
    drawn: the model's vocabulary is padded to a multiple of 128 · tp.

    `use_cache=False` recomputes the whole sequence with the model's own forward at every
    step (the reference the cache is tested against).
    """
    _check(model)
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    model.eval()
    device = model.output_weight().device
    length = len(prompt_ids) + max_new_tokens
    if length > model.config.seq_length:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's seq_length {model.config.seq_length}")
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([list(prompt_ids)], device=device)
    cache = None
    if use_cache:
        cfg = model.config
        cache = KVCache(cfg.num_layers, 1, cfg.num_query_groups, length, cfg.head_dim,
                        model.output_weight().dtype, device)
    out, step_input = [], ids
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = forward_with_cache(model, step_input, cache)
        else:
            logits = model(ids)[:, -1].float()
        if vocab_size is not None:
            logits[:, vocab_size:] = float("-inf")
        nxt = sample_next(logits, temperature, top_k, top_p, gen)
        out.append(int(nxt[0]))
        if eod is not None and out[-1] == eod:
            break
        step_input = nxt[:, None]
        ids = torch.cat([ids, step_input], dim=1)
    return out


def _tokenizer(src: str, tokenizer_file: Optional[str]):
    from tinytron.checkpoint._hf_tokenizer import run_special_tokens, run_tokenizer
    from tinytron.data.preprocess import EOD_CANDIDATES, TokenizerSpec, build_tokenizer

    kind, path = ("hf", tokenizer_file) if tokenizer_file else run_tokenizer(src)
    if kind != "hf":
        return build_tokenizer(TokenizerSpec(kind or "byte", path))
    eod, pad = run_special_tokens(src) if not tokenizer_file else (None, None)
    if eod is None:  # no run config: the first end-of-document token the tokenizer holds
        from tokenizers import Tokenizer
        try:
            vocab = Tokenizer.from_file(str(path)).get_vocab()
        except Exception:  # noqa: BLE001 - build_tokenizer names the file below
            vocab = {}
        eod = next((t for t in EOD_CANDIDATES if t in vocab), EOD_CANDIDATES[0])
    return build_tokenizer(TokenizerSpec("hf", path, eod, pad))


def check_request(args, tok, model) -> int:
    """The tokens that may be generated, or a ValueError naming the flag at fault."""
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model only "
                         f"{model.config.vocab_size}: not the tokenizer this model was trained "
                         "with (--tokenizer-file)")
    n = len(tok.encode(args.prompt))
    if n >= model.config.seq_length:
        raise ValueError(f"the prompt is {n} tokens, the model's seq_length "
                         f"{model.config.seq_length}: no room for --max-new-tokens "
                         f"{args.max_new_tokens}; shorten the prompt")
    return min(args.max_new_tokens, model.config.seq_length - n)


def parser() -> argparse.ArgumentParser:
    """The command line of `tinytron-generate` (the README's table lists its sampling defaults)."""
    p = argparse.ArgumentParser(prog="python -m tinytron.model._generate",
                                description="Generate text from a tinytron checkpoint.")
    p.add_argument("checkpoint", help="a checkpoint root or iter_* directory, either format")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-file", default=None,
                   help="a tokenizer.json (default: the run's [tokenizer], else bytes)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tinytron.model._generate CHECKPOINT --prompt TEXT`: exit 0, or 2 with one line."""
    args = parser().parse_args(argv)
    try:
        from tinytron.checkpoint.convert import read_checkpoint_model

        tok = _tokenizer(args.checkpoint, args.tokenizer_file)
        model = read_checkpoint_model(args.checkpoint)
        new = generate(model, tok.encode(args.prompt), check_request(args, tok, model),
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       eod=tok.eod, seed=args.seed, vocab_size=tok.vocab_size)
    except (ValueError, OSError) as err:
        print(f"generate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(args.prompt + tok.decode([i for i in new if i != tok.eod]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
