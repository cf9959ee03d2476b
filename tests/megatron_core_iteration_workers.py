"""Both sides of tests/test_train_megatron_core.py: one training run, twice, from the same weights.

The reference side is Megatron-LM's `train_step` (`megatron/training/training.py:2162` at
e03878b5f) assembled from megatron-core 0.16.1's own parts: `GPTModel` (local layer spec),
`DistributedDataParallel`, `get_megatron_optimizer`, `OptimizerParamScheduler`,
`get_forward_backward_func` with `finalize_model_grads` as the schedule's finalize hook, and
`GPTDataset` over the `.bin/.idx` that `tinytron-preprocess` wrote. The other side is
`tinytron.train.run` with a config, as a user runs it, resuming from the Megatron checkpoint
of the initial weights with `checkpoint.finetune`.

    python -m tests.megatron_core_iteration_workers ROOT DATA_PREFIX

writes the initial weights (megatron-core's saver forks writer processes, which a daemonic
`run_on_ranks` rank may not) and runs the one-rank cases; the last stdout line is their JSON.
`world_cases` runs the multi-rank cases inside a `run_on_ranks` world.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# One recipe, read by both sides. Every optimizer knob is off its default so that a side that
# ignores one shows up: warm-up from a non-zero lr, cosine decay that ends before the run does
# (the last two iterations sit at min_lr), clipping below the measured norms (2.2-3.6: every
# update is clipped), weight decay, Adam betas and eps.
RECIPE = dict(hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
              ffn_hidden_size=128, vocab_size=512, seq_length=64, micro_batch_size=2,
              global_batch_size=16, train_iters=12, seed=1234, lr=3e-3, min_lr=3e-4,
              lr_warmup_init=1e-4, lr_warmup_iters=3, lr_decay_iters=10,
              lr_decay_style="cosine", weight_decay=0.1, clip_grad=0.5, adam_beta1=0.85,
              adam_beta2=0.95, adam_eps=1e-6, init_std=0.02)
INIT_SEED = 7  # megatron-core's initialization of the shared starting weights


def init_root(root: str, tie: bool) -> str:
    """ROOT/initial_tied, ROOT/initial_untied: Megatron-LM checkpoint roots at iteration 0."""
    return os.path.join(root, "initial_tied" if tie else "initial_untied")


def _layout(tp=1, pp=1, vpp=None, distopt=False, tie=True, eod_mask_loss=False,
            per_token_loss=False, decoupled_lr=None, overlap=False, argv=()) -> dict:
    return dict(tp=tp, pp=pp, vpp=vpp, distopt=distopt, tie=tie, eod_mask_loss=eod_mask_loss,
                per_token_loss=per_token_loss, decoupled_lr=decoupled_lr, overlap=overlap,
                argv=list(argv))


# Each layout on both sides; `argv` is what tinytron's command line adds to the recipe (its data
# parallel size follows from the world size). No sequence parallelism: megatron-core's local
# spec without Apex normalizes with WrappedTorchNorm, which refuses it (torch_norm.py:32, 0.16.1).
PP2 = ["--parallel.pipeline_model_parallel_size", "2"]
LAYOUTS = {
    "one_rank": _layout(),
    "one_rank_untied": _layout(tie=False, argv=["--model.tie_embeddings", "false"]),
    # Megatron's --decoupled-lr/--decoupled-min-lr: the embedding and output layer's own schedule
    "one_rank_decoupled_lr": _layout(decoupled_lr=(1e-3, 1e-4), argv=[
        "--optimizer.decoupled_lr", "1e-3", "--optimizer.decoupled_min_lr", "1e-4"]),
    "dp2": _layout(),
    "dp2_distopt": _layout(distopt=True, argv=["--optimizer.use_distributed_optimizer", "true",
                                               "--ddp.overlap_grad_reduce", "true"]),
    "tp2": _layout(tp=2, argv=["--parallel.tensor_model_parallel_size", "2"]),
    "pp2": _layout(pp=2, argv=PP2),
    # EOD positions out of the loss: micro-batches (and DP ranks) count different tokens, so the
    # per-micro-batch mean (the default) and the per-token loss weight them differently
    "dp2_eod_mask": _layout(eod_mask_loss=True, argv=["--data.eod_mask_loss", "true"]),
    "dp2_eod_mask_per_token": _layout(eod_mask_loss=True, per_token_loss=True, argv=[
        "--data.eod_mask_loss", "true", "--ddp.calculate_per_token_loss", "true"]),
    "pp2_vpp2": _layout(pp=2, vpp=2, argv=PP2 + [
        "--parallel.virtual_pipeline_model_parallel_size", "2"]),
    # four ranks: one distributed optimizer over both chunks, both sides overlapping the grad
    # reduce-scatter and the param all-gather, the gathers dispatched chunk by chunk by the
    # interleaved schedule's param_sync_func (align_param_gather)
    "pp2_vpp2_dp2_distopt": _layout(pp=2, vpp=2, distopt=True, overlap=True, argv=PP2 + [
        "--parallel.virtual_pipeline_model_parallel_size", "2",
        "--optimizer.use_distributed_optimizer", "true", "--ddp.overlap_grad_reduce", "true",
        "--ddp.overlap_param_gather", "true", "--ddp.align_param_gather", "true"]),
}
# negative controls: tinytron run with one knob changed, compared with the unchanged reference
CONTROLS = {"adam_eps": ["--optimizer.adam_eps", "1e-8"],
            "warmup": ["--scheduler.lr_warmup_iters", "2"]}


# -- megatron-core on a CPU ---------------------------------------------------------------------
def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # device=0 means cuda:0


class _CudaNamesOnCpu(TorchFunctionMode):
    """megatron-core's hard-coded CUDA spellings, answered on CPU.

    Its buffers and scalars are made with `device="cuda"` or `torch.cuda.current_device()`
    (`clip_grads.py`, `schedules.py`, `p2p_communication.py`, `param_and_grad_buffer.py`) and
    its optimizers accept a parameter only if `param.type()` is `torch.cuda.FloatTensor`.
    This mode puts those tensors on the CPU and reports CPU float tensors by their CUDA type
    name; everything else runs unchanged.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_core_on_cpu():
    """Run megatron-core here: the CUDA names above, and three CUDA calls stubbed meanwhile."""
    from megatron.core.tensor_parallel import random as mrandom

    saved = (mrandom.CudaRNGStatesTracker.fork, torch.cuda.current_device, torch.cuda.synchronize)
    # the forward forks the model-parallel CUDA RNG stream; dropout is off, nothing is drawn
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None  # the checkpoint saver syncs before writing
    try:
        with _CudaNamesOnCpu():
            yield
    finally:
        (mrandom.CudaRNGStatesTracker.fork, torch.cuda.current_device,
         torch.cuda.synchronize) = saved


def _import_megatron_core():
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected
        warnings.simplefilter("ignore")
        import megatron.core.parallel_state  # noqa: F401  (settles an import cycle)
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401


def _transformer_config(tp: int = 1, pp: int = 1, vpp: int | None = None,
                        per_token_loss: bool = False):
    from megatron.core.transformer import TransformerConfig

    r = RECIPE
    return TransformerConfig(
        num_layers=r["num_layers"], hidden_size=r["hidden_size"],
        num_attention_heads=r["num_attention_heads"], num_query_groups=r["num_query_groups"],
        ffn_hidden_size=r["ffn_hidden_size"], tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        # Megatron-LM's arguments: an interleaved run overlaps its p2p by default, which
        # unbatches it (argument_utils.py:302); with PP 2 a batched exchange would hold two
        # sends between the same two ranks, which arguments.py:984 refuses
        overlap_p2p_comm=vpp is not None, batch_p2p_comm=vpp is None,
        calculate_per_token_loss=per_token_loss,
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        init_method_std=r["init_std"])


def _megatron_chunks(config, tie: bool) -> list:
    """This rank's model chunks of megatron-core's GPTModel (Llama-style: RMSNorm, SwiGLU, RoPE,
    GQA), one per virtual stage, as Megatron-LM's get_model builds them."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    vpp = config.virtual_pipeline_model_parallel_size
    stages = range(vpp) if vpp else [None]
    return [GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=RECIPE["vocab_size"], max_sequence_length=RECIPE["seq_length"],
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                     position_embedding_type="rope", share_embeddings_and_output_weights=tie,
                     vp_stage=v) for v in stages]


def _tensor_request(model) -> dict:
    """The model's sharded state dict without Transformer Engine's (here empty) extra states."""
    return {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}


def _read_weights(chunks: list, directory: str) -> list[dict]:
    """megatron-core's own loader: this layout's share of the model tensors in `directory`, all
    chunks in one request ("model0", "model1", … as Megatron-LM asks for virtual stages)."""
    from megatron.core import dist_checkpointing

    got = dist_checkpointing.load({f"model{i}": _tensor_request(c) for i, c in enumerate(chunks)},
                                  directory)
    return [{k: v for k, v in got[f"model{i}"].items() if torch.is_tensor(v)}
            for i in range(len(chunks))]


def _load_weights(chunks: list, directory: str) -> None:
    for chunk, weights in zip(chunks, _read_weights(chunks, directory)):
        missing, unexpected = chunk.load_state_dict(weights, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing,
                                                                                    unexpected)


def write_initial_weights(root: str, tie: bool) -> str:
    """megatron-core's freshly initialized GPTModel, saved as Megatron-LM saves a run.

    The layout is that of `megatron/training/checkpointing.py` at iteration 0: the tracker file
    `latest_checkpointed_iteration.txt`, and in `iter_0000000` the model's sharded state dict
    under "model" (its tensors keep their unprefixed keys) with the iteration and checkpoint
    version, written by megatron-core's `dist_checkpointing.save` (torch_dist).
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    top = init_root(root, tie)
    shutil.rmtree(top, ignore_errors=True)
    os.makedirs(os.path.join(top, "iter_0000000"))
    with megatron_core_on_cpu():
        ps.initialize_model_parallel(1, 1)
        try:
            torch.manual_seed(INIT_SEED)
            model, = _megatron_chunks(_transformer_config(), tie)
            dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 0,
                                     "checkpoint_version": 3.0}, os.path.join(top, "iter_0000000"))
        finally:
            ps.destroy_model_parallel()
    with open(os.path.join(top, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("0")
    return top


# -- the reference run: Megatron-LM's train_step over megatron-core's parts -----------------------
class _ByteTokenizer:
    """What GPTDataset asks of a tokenizer; the ids of tinytron's byte tokenizer."""

    def __init__(self):
        from tinytron.data.preprocess import TokenizerSpec, build_tokenizer

        tok = build_tokenizer(TokenizerSpec("byte", None))
        self.vocab_size, self.eod, self.pad = tok.vocab_size, tok.eod, tok.pad
        self.unique_identifiers = {"class": "ByteTokenizer"}


def _megatron_train_dataset(data_prefix: str, cache: str, eod_mask_loss: bool):
    """megatron-core's GPTDataset over the .bin/.idx: the train split of "98,2,0"."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    r = RECIPE
    config = GPTDatasetConfig(random_seed=r["seed"], sequence_length=r["seq_length"],
                              blend=([data_prefix], None), split="98,2,0",
                              tokenizer=_ByteTokenizer(), path_to_cache=cache,
                              reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=eod_mask_loss)
    samples = [r["train_iters"] * r["global_batch_size"], 0, 0]
    return BlendedMegatronDatasetBuilder(GPTDataset, samples, lambda: True, config).build()[0]


def _microbatches(dataset, dp_rank: int, dp: int):
    """Megatron's MegatronPretrainingSampler order (`megatron/training/datasets/
    data_samplers.py:115`): consecutive groups of micro_batch_size · dp samples, rank r taking
    the r-th slice of each.
    Every TP and PP rank reads the same micro-batches itself (Megatron's get_batch broadcasts
    them from TP rank 0, which gives the same tensors)."""
    mbs, start = RECIPE["micro_batch_size"], dp_rank * RECIPE["micro_batch_size"]
    while True:
        items = [dataset[i] for i in range(start, start + mbs)]
        start += mbs * dp
        yield {k: torch.stack([torch.as_tensor(x[k]) for x in items]) for k in items[0]}


def _loss_func(loss_mask, output_tensor):
    """pretrain_gpt.py:121: the masked sum, the token count, and the [sum, count] report."""
    losses = output_tensor.view(-1).float()
    loss = torch.sum(losses * loss_mask.view(-1).float())
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                    num_tokens.view(1)])}


def _forward_step(data_iterator, model):
    """pretrain_gpt.py:183: the batch through the model with labels (per-token losses out)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _megatron_parts(layout: dict, initial: str):
    """Model chunks (initial weights loaded), DDP, optimizer, scheduler: Megatron-LM's
    setup_model_and_optimizer (training.py:1938) with this recipe's arguments."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import (OptimizerConfig, get_megatron_optimizer,
                                         get_standard_config_overrides)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    r, gbs = RECIPE, RECIPE["global_batch_size"]
    config = _transformer_config(layout["tp"], layout["pp"], layout["vpp"],
                                 layout["per_token_loss"])
    torch.manual_seed(INIT_SEED + 1)  # any initialization: the checkpoint overwrites it
    chunks = _megatron_chunks(config, layout["tie"])
    _load_weights(chunks, os.path.join(initial, "iter_0000000"))
    overlap = layout["overlap"]
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=layout["distopt"], overlap_grad_reduce=overlap,
        overlap_param_gather=overlap, align_param_gather=overlap)
    # get_model: only the first chunk is split into buckets (the others are one bucket each)
    ddp = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
           for i, chunk in enumerate(chunks)]
    decoupled_lr, decoupled_min_lr = layout["decoupled_lr"] or (None, None)
    opt_config = OptimizerConfig(
        lr=r["lr"], min_lr=r["min_lr"], weight_decay=r["weight_decay"], clip_grad=r["clip_grad"],
        adam_beta1=r["adam_beta1"], adam_beta2=r["adam_beta2"], adam_eps=r["adam_eps"],
        use_distributed_optimizer=layout["distopt"], decoupled_lr=decoupled_lr,
        decoupled_min_lr=decoupled_min_lr)
    # training.py:1894: no weight decay on biases and 1-D tensors, the decoupled lr groups
    optimizer = get_megatron_optimizer(opt_config, ddp,
                                       config_overrides=get_standard_config_overrides(opt_config))
    # Megatron-LM's get_optimizer_param_scheduler: every length in samples (iterations · gbs)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=r["lr_warmup_init"], max_lr=r["lr"], min_lr=r["min_lr"],
        lr_warmup_steps=r["lr_warmup_iters"] * gbs, lr_decay_steps=r["lr_decay_iters"] * gbs,
        lr_decay_style=r["lr_decay_style"], start_wd=r["weight_decay"],
        end_wd=r["weight_decay"], wd_incr_steps=r["train_iters"] * gbs,
        wd_incr_style="constant")
    config.grad_scale_func = optimizer.scale_loss          # training.py:3227
    config.finalize_model_grads_func = finalize_model_grads  # training.py:3245
    if overlap:  # training.py:3228-3242: each chunk's callbacks, as a list (virtual stages)
        config.no_sync_func = [c.no_sync for c in ddp]
        config.grad_sync_func = [c.start_grad_sync for c in ddp]
        config.param_sync_func = [_counted(c.start_param_sync) for c in ddp]
    return chunks, ddp, optimizer, scheduler


PARAM_SYNC_CALLS = [0]  # how often megatron-core's schedule called a chunk's param_sync_func


def _counted(fn):
    def call(*args, **kwargs):
        PARAM_SYNC_CALLS[0] += 1
        return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def _first_iteration(ddp: list, iteration: int):
    """training.py:3374-3379, 3569-3573: with the overlapped gather the first iteration runs
    without the forward pre-hooks and without param_sync_func (the weights are complete); both
    come back after its step."""
    config = ddp[0].config
    if iteration != 1 or not ddp[0].ddp_config.overlap_param_gather:
        yield
        return
    held, config.param_sync_func = config.param_sync_func, None
    for chunk in ddp:
        chunk.disable_forward_pre_hook(param_sync=False)
    yield
    for chunk in ddp:
        chunk.enable_forward_pre_hook()
    config.param_sync_func = held


def _train_step(ddp: list, optimizer, scheduler, data_iterator, num_microbatches: int, dp: int):
    """One iteration in `train_step`'s order (training.py:2162-2345)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in ddp:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=data_iterator, model=ddp,
        num_microbatches=num_microbatches, seq_length=RECIPE["seq_length"],
        micro_batch_size=RECIPE["micro_batch_size"], forward_only=False)
    update_successful, grad_norm, _ = optimizer.step()
    # training.py:2303-2306: AND / MAX over the model-parallel group
    stats = torch.tensor([0.0 if update_successful else 1.0, grad_norm or 0.0], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=ps.get_model_parallel_group())
    assert stats[0] == 0, "megatron-core skipped an update"
    scheduler.step(increment=num_microbatches * RECIPE["micro_batch_size"] * dp)  # :2317
    record = {"grad_norm": float(stats[1]),
              "learning_rate": get_canonical_lr_for_logging(optimizer.param_groups)}
    if ps.is_pipeline_last_stage(ignore_virtual=True):  # :2327-2341: the token mean over the batch
        total = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0).double()
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        record["lm loss"] = float(total[0] / total[1])
    return record


def _weights(chunks) -> dict:
    """Every tensor of this rank's chunks, keyed 'chunk.name'."""
    return {f"{i}.{k}": v.detach().clone() for i, c in enumerate(chunks)
            for k, v in c.state_dict().items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")}


def megatron_run(layout_name: str, data_prefix: str, initial: str, cache: str,
                 compare_with: dict[str, str]) -> dict:
    """The reference run of one layout; then each of tinytron's final checkpoints, read into
    this layout by megatron-core's own loader, compared tensor by tensor with its weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    layout = LAYOUTS[layout_name]
    with megatron_core_on_cpu():
        ps.initialize_model_parallel(layout["tp"], layout["pp"],
                                     virtual_pipeline_model_parallel_size=layout["vpp"])
        try:
            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            chunks, ddp, optimizer, scheduler = _megatron_parts(layout, initial)
            dataset = _megatron_train_dataset(data_prefix, cache, layout["eod_mask_loss"])
            # virtual stages: one iterator per chunk over the same samples (training.py builds
            # the iterators once per chunk)
            data = [_microbatches(dataset, dp_rank, dp) for _ in chunks]
            m = RECIPE["global_batch_size"] // (RECIPE["micro_batch_size"] * dp)
            records = []
            for it in range(1, RECIPE["train_iters"] + 1):
                with _first_iteration(ddp, it):
                    records.append({"iteration": it, **_train_step(
                        ddp, optimizer, scheduler, data if layout["vpp"] else data[0], m, dp)})
            if layout["overlap"]:  # the last step's gather, as a save forces it (training.py:2788)
                for chunk in ddp:
                    chunk.start_param_sync(force_sync=True)
            trained = _weights(chunks)
            parts = {"optimizer": sorted({type(o).__name__ for o in optimizer.chained_optimizers}),
                     "param_sync_calls": PARAM_SYNC_CALLS[0],
                     "schedule": get_forward_backward_func().__name__}
            gaps = {}
            for name, directory in compare_with.items():  # reading overwrites the model's tensors
                theirs = {f"{i}.{k}": v for i, w in enumerate(_read_weights(chunks, directory))
                          for k, v in w.items()}
                gaps[name] = {k: float((theirs[k] - trained[k]).abs().max()) for k in theirs}
        finally:
            ps.destroy_model_parallel()
    return {"records": records, "weight_gaps": gaps, "num_tensors": len(trained), **parts,
            "weight_scale": max(float(v.abs().max()) for v in trained.values())}


# -- tinytron.train, as a user runs it ----------------------------------------------------------
def tinytron_argv(data_prefix: str, initial: str, save: str, extra: list[str]) -> list[str]:
    """The same recipe as tinytron.train's command line, resuming the initial weights only."""
    r = RECIPE
    keys = {"model": ["hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                      "ffn_hidden_size", "vocab_size", "seq_length"],
            "training": ["micro_batch_size", "global_batch_size", "train_iters", "seed"],
            "optimizer": ["lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1",
                          "adam_beta2", "adam_eps"],
            "scheduler": ["lr_warmup_init", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style"]}
    argv = [w for section, names in keys.items() for k in names
            for w in (f"--{section}.{k}", str(r[k]))]
    return argv + [
        "--training.log_interval", "1", "--training.eval_interval", "none",
        "--training.save_interval", str(r["train_iters"]), "--data.data_path", data_prefix,
        "--data.split", '"98,2,0"', "--data.num_workers", "0",
        "--checkpoint.load", initial, "--checkpoint.finetune", "true",
        "--checkpoint.save", save, "--logging.progress_bar", "false", *extra]


def read_records(jsonl: str) -> list[dict]:
    """Per-iteration loss, grad norm and learning rate from tinytron's JSONL log."""
    out = []
    for line in open(jsonl):
        r = json.loads(line)
        if "losses" in r:
            out.append({"iteration": r["iteration"], "lm loss": r["losses"].get("lm loss"),
                        "grad_norm": r.get("grad_norm"), "learning_rate": r.get("learning_rate")})
    return out


def tinytron_run(name: str, data_prefix: str, initial: str, root: str, extra: list[str]) -> dict:
    """One tinytron.train run as tests/test_train.py runs it: resolve_config + run, this world."""
    from tinytron.train import resolve_config, run

    save = os.path.join(root, name)
    argv = tinytron_argv(data_prefix, initial, save, extra)
    code = run(resolve_config(argv, dist.get_world_size()), argv, name)
    jsonl = os.path.join(save, "log.jsonl")
    return {"code": code, "save": save,
            "records": read_records(jsonl) if os.path.isfile(jsonl) else None}


def _final_checkpoint(save: str) -> str:
    return os.path.join(save, f"iter_{RECIPE['train_iters']:07d}")


def run_case(layout: str, root: str, data_prefix: str, controls: dict | None = None) -> dict:
    """tinytron's run(s) first, then megatron-core's on that layout, which reads their weights."""
    initial = init_root(root, LAYOUTS[layout]["tie"])
    runs = {layout: LAYOUTS[layout]["argv"]}
    runs.update({f"{layout}_{c}": LAYOUTS[layout]["argv"] + extra
                 for c, extra in (controls or {}).items()})
    ours = {name: tinytron_run(name, data_prefix, initial, root, extra)
            for name, extra in runs.items()}
    dist.barrier()
    theirs = megatron_run(layout, data_prefix, initial, os.path.join(root, "mcore_cache"),
                          {name: _final_checkpoint(r["save"]) for name, r in ours.items()})
    dist.barrier()
    return {"tinytron": ours, "megatron_core": theirs}


def world_cases(root: str, data_prefix: str, layouts: list[str]) -> dict:
    """Every multi-rank layout in one world (each world start costs seconds on 2 cores)."""
    _import_megatron_core()
    return {layout: run_case(layout, root, data_prefix) for layout in layouts}


def one_rank_cases(root: str, data_prefix: str) -> dict:
    """The initial weights (tied and untied), then the one-rank runs and the negative controls."""
    _import_megatron_core()
    for tie in (True, False):
        write_initial_weights(root, tie)
    out = {"one_rank": run_case("one_rank", root, data_prefix, CONTROLS)}
    out.update({layout: run_case(layout, root, data_prefix)
                for layout in ("one_rank_untied", "one_rank_decoupled_lr")})
    return out


if __name__ == "__main__":
    root_dir, prefix = sys.argv[1:3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root_dir, "store"), 1),
                            rank=0, world_size=1)
    try:
        result = one_rank_cases(root_dir, prefix)
    finally:
        dist.destroy_process_group()
    print(json.dumps(result))
