"""The `tinytron-convert` command line: flags, the from-hf target check, exit status 2.

The conversions themselves are the page `chapters/03_checkpoint/convert.py`; this module is how
the shell reaches them. `main` and `check_target` are re-exported there, where the console
script points.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["check_target", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinytron-convert",
                                description="Convert checkpoints to and from Hugging Face Llama.")
    p.add_argument("direction", choices=["to-hf", "from-hf"])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--num-attention-heads", type=int, default=None,
                   help="heads, for checkpoints without a model config (e.g. Megatron-Core's)")
    p.add_argument("--num-query-groups", type=int, default=None)
    p.add_argument("--rotary-base", type=int, default=None)
    p.add_argument("--norm-epsilon", type=float, default=None)
    p.add_argument("--tokenizer-file", default=None,
                   help="to-hf: the tokenizer.json to export with the weights (default: the "
                        "run's [tokenizer] from config.toml beside the checkpoint)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="unpickle common.pt in full (can run code: a checkpoint you trust only)")
    p.add_argument("--format", dest="ckpt_format", choices=["torch_dist", "torch"],
                   default="torch_dist", help="checkpoint format written by from-hf")
    p.add_argument("--force", action="store_true",
                   help="from-hf: write into a CHECKPOINT_ROOT that is not empty (its tracker "
                        "is rewritten to iteration 0: a run there would restart from it)")
    return p


def check_target(dst, force: bool = False) -> None:
    """ValueError when from-hf would write into a non-empty directory (a run's, maybe)."""
    from tinytron.checkpoint.formats import read_tracker

    path = Path(dst)
    if force or not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    found = read_tracker(path)
    if found is not None:
        raise ValueError(f"{path} holds a checkpoint (tracker at iteration "
                         f"{'release' if found[1] else found[0]}): writing iteration 0 there "
                         "would make the next resume start over; pick a new directory, or "
                         "pass --force")
    if any(path.iterdir()):
        raise ValueError(f"{path} is not empty: pick a new directory, or pass --force")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `tinytron-convert`: exit status 0, or 2 with a one-line error."""
    from tinytron.checkpoint.convert import checkpoint_to_hf, hf_to_checkpoint

    args = _parser().parse_args(argv)
    try:
        if args.direction == "to-hf":
            extra = {k: v for k, v in (("rotary_base", args.rotary_base),
                                       ("norm_epsilon", args.norm_epsilon)) if v is not None}
            config = checkpoint_to_hf(args.src, args.dst,
                                      num_attention_heads=args.num_attention_heads,
                                      num_query_groups=args.num_query_groups,
                                      trust_pickle=args.trust_pickle,
                                      tokenizer_file=args.tokenizer_file, **extra)
        else:
            check_target(args.dst, args.force)
            config = hf_to_checkpoint(args.src, args.dst, args.ckpt_format)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"tinytron-convert: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    tokenizer = (" with its tokenizer" if args.direction == "to-hf"
                 and (Path(args.dst) / "tokenizer.json").is_file() else "")
    print(f"tinytron-convert: {args.src} -> {args.dst} ({config.num_layers} layers, "
          f"h {config.hidden_size}, V {config.vocab_size}){tokenizer}")
    return 0
