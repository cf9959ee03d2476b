"""Subprocess entry points of the checkpoint tests: real processes that die by SIGKILL at a chosen
point of a save, that hit a file-size limit, and that run megatron-core next to tinytron.

    python -m tests.checkpoint_workers kill ROOT FORMAT MODE POINT
    python -m tests.checkpoint_workers fsize ROOT
    python -m tests.checkpoint_workers megatron ROOT

Each prints one JSON line on success. Megatron-core's saver starts a multiprocessing Manager,
so everything runs under the `__main__` guard.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys

import torch
import torch.nn.functional as F


def tiny_training(seed: int = 0):
    """(config, model, optimizer, step function) of a small one-process AdamW run."""
    from tinytron.model import GPTModel, tiny_config
    from tinytron.optimizer import AdamW
    from tinytron.optimizer.mixed_precision import MixedPrecisionOptimizer

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    config = tiny_config(hidden_size=48, ffn_hidden_size=96, seq_length=16)
    model = GPTModel(config)
    opt = MixedPrecisionOptimizer(AdamW(model.parameters(), lr=1e-2), clip_grad=1.0)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_length + 1), generator=g)
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        opt.step()
        opt.zero_grad()

    return config, model, opt, step


def _manager(root: str, fmt: str, mode: str):
    from tinytron.checkpoint import CheckpointConfig, CheckpointManager
    from tinytron.parallel import ParallelGrid

    cfg = CheckpointConfig(save=root, load=root, ckpt_format=fmt, async_save=mode != "sync",
                           async_mode="thread" if mode == "thread" else "process")
    return CheckpointManager(cfg, ParallelGrid.single())


def _first_save(root: str, fmt: str, mode: str):
    """Train one step, save iteration 1 completely; keep its weights beside the root."""
    from tinytron.checkpoint.resume import TrainStateFallback

    config, model, opt, step = tiny_training()
    manager, state = _manager(root, fmt, mode), TrainStateFallback()
    step(1)
    state.iteration, state.consumed_train_samples = 1, 2
    manager.save(state, model, opt)
    manager.finalize(blocking=True)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, root + ".expected.pt")
    return manager, state, model, opt, step


def kill(root: str, fmt: str, mode: str, point: str) -> dict:
    """Save iteration 1, then die (SIGKILL, from the environment) at `point` of saving iteration 2."""
    from tinytron.checkpoint.formats import FAULT_ENV, CheckpointSaveError

    manager, state, model, opt, step = _first_save(root, fmt, mode)
    os.environ[FAULT_ENV] = point
    step(2)
    state.iteration, state.consumed_train_samples = 2, 4
    try:
        manager.save(state, model, opt)
        for i in range(3, 6):   # training goes on while an async writer works
            manager.finalize(blocking=False)
            step(i)
        manager.finalize(blocking=True)
    except CheckpointSaveError as e:
        return {"survived": True, "error": str(e)}
    return {"survived": True, "error": None}


def fsize(root: str) -> dict:
    """A save that hits RLIMIT_FSIZE halfway, in every format and mode; the run survives it."""
    from tinytron.checkpoint import load_checkpoint
    from tinytron.checkpoint.formats import CheckpointSaveError, read_tracker

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG from write() instead of dying
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    out = {}
    for fmt, mode in (("torch_dist", "sync"), ("torch_dist", "process"), ("torch_dist", "thread"),
                      ("torch", "sync")):
        r = f"{root}/{fmt}_{mode}"
        manager, state, model, opt, step = _first_save(r, fmt, mode)
        step(2)
        state.iteration = 2
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        try:
            manager.save(state, model, opt)
            manager.finalize(blocking=True)
            error = None
        except CheckpointSaveError as e:
            error = str(e)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        _, fresh, fresh_opt, _ = tiny_training(seed=5)
        loaded = load_checkpoint(r, fresh, fresh_opt, ckpt_format=fmt)
        expected = torch.load(r + ".expected.pt", weights_only=True)
        out[f"{fmt}_{mode}"] = {
            "error": error, "tracker": read_tracker(r)[0], "loaded_iteration": loaded.iteration,
            "weights_ok": all(torch.equal(p, expected[n]) for n, p in fresh.named_parameters())}
    return out


# -- megatron-core interop ----------------------------------------------------------------------
def _megatron_setup() -> None:
    """megatron-core 0.16.1 on CPU: gloo world of one, and the three CUDA-only calls stubbed."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    # Forward forks the model-parallel CUDA RNG stream; with dropout off nothing is drawn.
    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None   # the saver syncs before writing
    torch.cuda.current_device = lambda: "cpu"       # and broadcasts a failure flag "on device"
    parallel_state.initialize_model_parallel(1, 1)


def _megatron_gpt(cfg, seed: int):
    """Megatron-Core's GPTModel (local layer spec) with the shape of a tinytron ModelConfig."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    tc = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, init_method_std=cfg.init_std)
    return GPTModel(tc, get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                    position_embedding_type="rope", rotary_base=cfg.rotary_base,
                    share_embeddings_and_output_weights=cfg.tie_embeddings).eval()


def _megatron_logits(model, tokens):
    b, s = tokens.shape
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)   # True = masked
    with torch.no_grad():
        return model(tokens, torch.arange(s).expand(b, s), mask)


def _interop(root: str, name: str, cfg, tokens) -> dict:
    """One config: Megatron-Core -> tinytron (and -> HF), tinytron -> Megatron-Core."""
    from megatron.core import dist_checkpointing

    from tinytron.checkpoint import load_model_weights, save_model_weights
    from tinytron.checkpoint.convert import main as convert
    from tinytron.model import GPTModel
    from tinytron.model.hf import load_hf_llama

    out, mdir = {}, f"{root}/mcore_{name}"
    mcore = _megatron_gpt(cfg, 1)
    os.makedirs(mdir)
    dist_checkpointing.save(mcore.sharded_state_dict(), mdir)
    reference = _megatron_logits(mcore, tokens)
    ours = GPTModel(cfg.replace(seed=3)).eval()
    load_model_weights(mdir, ours)
    out[f"convert_status_{name}"] = convert(
        ["to-hf", mdir, f"{root}/hf_{name}", "--num-attention-heads",
         str(cfg.num_attention_heads), "--num-query-groups", str(cfg.num_query_groups)])
    hf, _ = load_hf_llama(f"{root}/hf_{name}")
    ours2 = GPTModel(cfg.replace(seed=7)).eval()
    save_model_weights(ours2, f"{root}/tinytron_{name}")
    mcore2 = _megatron_gpt(cfg, 2)
    mcore2.load_state_dict(dist_checkpointing.load(mcore2.sharded_state_dict(),
                                                   f"{root}/tinytron_{name}"), strict=True)
    with torch.no_grad():
        out[f"mcore_to_tinytron_{name}"] = float((ours(tokens) - reference).abs().max())
        out[f"mcore_to_hf_{name}"] = float((hf.eval()(tokens) - reference).abs().max())
        out[f"tinytron_to_mcore_{name}"] = float((_megatron_logits(mcore2, tokens)
                                                  - ours2(tokens)).abs().max())
    out[f"logit_scale_{name}"] = float(reference.abs().max())
    # file sets: megatron-core 0.16.1 saves with 2 writer threads per rank by default, Megatron
    # at e03878b5f with 1 (strategies/torch.py:600), tinytron's default; both against tinytron
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    one = get_default_save_sharded_strategy()
    one.thread_count = 1
    dist_checkpointing.save(mcore.sharded_state_dict(), _fresh(f"{root}/mcore1_{name}"), one)
    save_model_weights(ours2, f"{root}/tinytron2_{name}", thread_count=2)
    for label, d in (("mcore", mdir), ("mcore1", f"{root}/mcore1_{name}"),
                     ("tinytron", f"{root}/tinytron_{name}"),
                     ("tinytron2", f"{root}/tinytron2_{name}")):
        out[f"files_{label}_{name}"] = sorted(os.listdir(d))
    return out


def _fresh(path: str) -> str:
    os.makedirs(path)
    return path


def megatron(root: str) -> dict:
    """Tied and untied, GQA and MHA: the logit gaps of every direction."""
    from tinytron.model import tiny_config

    _megatron_setup()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for tie, groups in ((True, 2), (False, 2), (False, 4)):
        # init_std 0.2: logits of size ~5, so that a 1e-5 gap is a real agreement
        cfg = tiny_config(tie_embeddings=tie, num_query_groups=groups, init_std=0.2)
        out.update(_interop(root, f"tie{int(tie)}_g{groups}", cfg, tokens))
    # a whole training checkpoint with the default options: the same file names
    from tinytron.checkpoint import save_checkpoint
    from tinytron.checkpoint.resume import TrainStateFallback

    _, model, opt, step = tiny_training()
    step(0)
    save_checkpoint(f"{root}/full", TrainStateFallback(iteration=1), model, opt)
    out["files_full_checkpoint"] = sorted(os.listdir(f"{root}/full/iter_0000001"))
    return out


if __name__ == "__main__":
    command, root, *rest = sys.argv[1:]
    if command == "kill":
        result = kill(root, *rest)
    elif command == "fsize":
        result = fsize(root)
    elif command == "megatron":
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store", 1), rank=0,
                                world_size=1)
        result = megatron(root)
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result))
