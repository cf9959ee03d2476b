"""Rank functions that measure a layout's memory and put the ledger's prediction beside it.

Not a page: the chapter's pages, its tests and its benchmark spawn these by name through
`tinytron.launch.run_on_ranks`. One world runs many cases (each case builds its own grid, model,
DDP buffers and optimizer), because starting a world costs seconds and a case a fraction of one.

Every number measured here is live tensor-storage bytes from chapter 01's `LiveBytesMeter`
(CPU: a dispatch mode over storages; CUDA: the allocator), or `storage_bytes` of the objects
that hold a term (the parameters, the grad buffers, the optimizer's masters and state).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
from tinytron.main_loop.memory_meter import LiveBytesMeter, storage_bytes
from tinytron.main_loop.schedules import ScheduleConfig, _unwrap, get_forward_backward_func
from tinytron.memory.activations import CPU_RNG_STATE, chunk_saved, saved_bytes
from tinytron.memory.peak import activation_peak
from tinytron.memory.states import MemoryConfig, state_ledger
from tinytron.model.config import tiny_config
from tinytron.model.gpt import build_stage_models
from tinytron.optimizer import OptimizerConfig, get_megatron_optimizer
from tinytron.overview.loss import lm_loss_func
from tinytron.parallel import ParallelGrid
from tinytron.parallel.rng import model_parallel_seed
from tinytron.recompute.recompute import apply_recompute

_GRIDS: dict = {}
_MODEL_KEYS = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
               "ffn_hidden_size", "vocab_size", "seq_length", "tie_embeddings", "dropout")


def _grid(tp: int, cp: int, pp: int) -> ParallelGrid:
    """One grid per layout per process (building one creates every process group)."""
    if (tp, cp, pp) not in _GRIDS:
        _GRIDS[(tp, cp, pp)] = ParallelGrid(tp=tp, cp=cp, pp=pp)
    return _GRIDS[(tp, cp, pp)]


def case_config(case: dict, world_size: int, device: str = "cpu") -> MemoryConfig:
    """The MemoryConfig of a case dict (tp, cp, pp, vpp, sp, mbs, m, distopt, ... + model keys)."""
    tp, cp, pp = case.get("tp", 1), case.get("cp", 1), case.get("pp", 1)
    offload = case.get("act_offload")
    model = tiny_config(sequence_parallel=case.get("sp", False),
                        recompute_granularity=case.get("recompute"),
                        recompute_method=case.get("method"),
                        recompute_num_layers=case.get("recompute_layers"),
                        recompute_modules=case.get("modules"),
                        distribute_saved_activations=case.get("distribute", False),
                        fine_grained_activation_offloading=offload is not None,
                        offload_modules=offload, min_offloaded_tensor_size=case.get("min_offload",
                                                                                   1024 * 1024),
                        **{k: case[k] for k in _MODEL_KEYS if k in case})
    return MemoryConfig(
        model, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=case.get("vpp"), context_parallel_size=cp,
        data_parallel_size=world_size // (tp * cp * pp), micro_batch_size=case.get("mbs", 1),
        num_microbatches=case.get("m", 1), bf16=case.get("bf16", True),
        grad_reduce_in_fp32=case.get("grad_fp32", True),
        use_distributed_optimizer=case.get("distopt", False),
        overlap_grad_reduce=case.get("overlap", False), bucket_size=case.get("bucket_size"),
        optimizer_cpu_offload=case.get("offload") is not None,
        optimizer_offload_fraction=case.get("offload") or 1.0, device=device)


def _build(cfg: MemoryConfig, grid: ParallelGrid):
    """Model chunks in the case's dtype, each wrapped in chapter 05's DDP."""
    model_parallel_seed(1234, grid)  # the TP-forked dropout stream
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    chunks = build_stage_models(cfg.model, grid, num_virtual_stages=cfg.num_chunks, dtype=dtype)
    if cfg.model.recompute_granularity or cfg.model.fine_grained_activation_offloading:
        apply_recompute(chunks)  # chapter 06's checkpoints and offload groups
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32 and cfg.bf16,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_grad_reduce=cfg.overlap_grad_reduce, bucket_size=cfg.bucket_size)
    return chunks, [DistributedDataParallel(c, grid, ddp_cfg) for c in chunks]


def _state_tensors(optimizers) -> list[torch.Tensor]:
    """Every tensor in the state dicts of these (torch) optimizers."""
    return [v for o in optimizers for st in o.state.values() for v in st.values()
            if torch.is_tensor(v)]


def _optimizer_parts(opt) -> dict[str, list[torch.Tensor]]:
    """The tensors behind each optimizer term: masters, device state, host copies and state."""
    # an fp32 param's master is a view of the param itself (Megatron's shard, no copy)
    masters = [m for p, m in opt.pairs if m is not p
               and m.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()]
    inner = opt.optimizer
    host_of = getattr(inner, "host_of", None)
    if host_of is None:
        device_opts, host = [inner], []
    else:  # chapter 02's HybridDeviceOptimizer
        device_opts = [inner.device_optimizer] if inner.device_optimizer else []
        host = [*host_of.values(), *(h.grad for h in host_of.values()),
                *_state_tensors(inner.cpu_optimizers)]
    buffers = {p.main_grad.untyped_storage().data_ptr() for p, _ in opt.pairs
               if getattr(p, "main_grad", None) is not None}
    copies = [m.grad for m in masters if m.grad is not None
              and m.grad.untyped_storage().data_ptr() not in buffers]
    return {"master_params": masters, "optimizer_state": _state_tensors(device_opts),
            "host_optimizer": host, "fp32_grad_copies": copies}


def measure_states(cfg: MemoryConfig, grid: ParallelGrid) -> tuple[dict, list, list]:
    """Measured resident bytes of this rank (and the built chunks and DDP wrappers)."""
    chunks, ddps = _build(cfg, grid)
    measured = {"weights": storage_bytes(p for c in chunks for p in c.parameters()),
                "grad_buffer": storage_bytes(b.grad_data for d in ddps for b in d.buffers)}
    opt_cfg = OptimizerConfig(lr=1e-3, bf16=cfg.bf16, optimizer=cfg.optimizer,
                              use_distributed_optimizer=cfg.use_distributed_optimizer,
                              optimizer_cpu_offload=cfg.optimizer_cpu_offload,
                              optimizer_offload_fraction=cfg.optimizer_offload_fraction)
    with LiveBytesMeter(grid.device) as meter:
        opts = [get_megatron_optimizer(opt_cfg, d.module, grid, d) for d in ddps]
        for o in opts:
            o.step()  # creates the lazy moments
        new_bytes = meter.settled()  # after the optimizer's collectives (see settled)
    parts: dict[str, list] = {}
    for o in opts:
        for key, tensors in _optimizer_parts(o).items():
            parts.setdefault(key, []).extend(tensors)
    measured.update({k: storage_bytes(v) for k, v in parts.items()})
    measured["optimizer_new_bytes"] = new_bytes  # everything the optimizer allocated, one number
    return measured, chunks, ddps


def _microbatch(cfg: MemoryConfig, grid: ParallelGrid, seed: int) -> dict:
    """Token ids and labels of this rank's CP slice of one micro-batch."""
    g = torch.Generator().manual_seed(seed)
    s_c = cfg.model.seq_length // cfg.context_parallel_size
    size = (cfg.micro_batch_size, s_c)
    return {k: torch.randint(0, cfg.model.vocab_size, size, generator=g).to(grid.device)
            for k in ("tokens", "labels")}


def measure_chunk(cfg: MemoryConfig, grid: ParallelGrid, chunk, index: int) -> dict:
    """Bytes one micro-batch leaves on a chunk after forward, and the peaks of forward/backward."""
    first, last = chunk.pre_process, chunk.post_process
    with LiveBytesMeter(grid.device) as meter:
        batch = _microbatch(cfg, grid, seed=index)
        if not first:
            s_r = (cfg.model.seq_length // cfg.context_parallel_size
                   // (cfg.tensor_model_parallel_size if cfg.model.sequence_parallel else 1))
            received = torch.randn(s_r, cfg.micro_batch_size, cfg.model.hidden_size,
                                   dtype=chunk.decoder.layers[0].input_layernorm.weight.dtype,
                                   device=grid.device, requires_grad=True)
            chunk.set_input_tensor(received)
        out = chunk(batch["tokens"] if first else None, labels=batch["labels"] if last else None)
        del batch
        kept, forward_peak = meter.settled(), meter.peak  # after the loss's all-reduces
        meter.reset_peak()
        out.backward(torch.ones_like(out) if last else torch.randn_like(out))
        backward_peak = meter.peak - kept
        del out
        chunk.set_input_tensor(None)
    return {"kept": kept, "forward_peak": forward_peak - kept, "backward_peak": backward_peak}


def _batches(cfg: MemoryConfig, grid: ParallelGrid, chunk: int):
    """Micro-batches created on demand (inside the meter, as a data loader would)."""
    for i in range(cfg.num_microbatches):
        batch = _microbatch(cfg, grid, seed=1000 * chunk + i)
        batch["loss_mask"] = torch.ones(batch["tokens"].shape, device=grid.device)
        yield batch


def _forward_step(data_iterator, model):
    """Chapter 01's contract: tokens on the first chunk, labels and the loss on the last."""
    batch = next(data_iterator)
    inner = _unwrap(model)
    out = model(batch["tokens"] if inner.pre_process else None,
                labels=batch["labels"] if inner.post_process else None)
    return out, partial(lm_loss_func, batch["loss_mask"])


def measure_schedule(cfg: MemoryConfig, grid: ParallelGrid, ddps: list) -> dict:
    """Peak live bytes over one forward_backward of m micro-batches (chapter 01's schedule)."""
    for d in ddps:
        d.zero_grad_buffer()
    fb = get_forward_backward_func(cfg.pipeline_model_parallel_size,
                                   cfg.virtual_pipeline_model_parallel_size)
    sched = ScheduleConfig(pipeline_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
                           no_sync_func=[d.no_sync for d in ddps])
    with LiveBytesMeter(grid.device) as meter:
        iters = [_batches(cfg, grid, c) for c in range(len(ddps))]
        fb(forward_step_func=_forward_step, data_iterator=iters if len(ddps) > 1 else iters[0],
           model=ddps, num_microbatches=cfg.num_microbatches, seq_length=cfg.model.seq_length,
           micro_batch_size=cfg.micro_batch_size, grid=grid, config=sched)
        del iters
        return {"peak": meter.peak, "after": meter.settled()}


def predict_chunk(cfg: MemoryConfig, pp_rank: int, index: int) -> dict:
    """The ledger's bytes for what measure_chunk measures (kept = saved + the chunk's output)."""
    # the CPU generator's snapshot is real memory the meter cannot see (made outside dispatch)
    parts = {k: [e for e in v if not e.what.startswith(CPU_RNG_STATE)]
             for k, v in chunk_saved(cfg, pp_rank, index).items()}
    x = cfg.model
    last = pp_rank == cfg.pipeline_model_parallel_size - 1 and index == cfg.num_chunks - 1
    output = 0 if last else cfg.param_bytes * cfg.micro_batch_size * x.hidden_size * (
        x.seq_length // cfg.context_parallel_size
        // (cfg.tensor_model_parallel_size if x.sequence_parallel else 1))
    return {"kept": sum(saved_bytes(v) for k, v in parts.items() if k != "host") + output,
            "parts": {k: saved_bytes(v) for k, v in parts.items()}}


def predict(result: dict) -> dict:
    """The ledger's numbers for a measured result (computed where the ledger code is)."""
    cfg = case_config(result["case"], result["world_size"], result["device"])
    r, d = result["pp_rank"], result["dp_cp_rank"]
    return {"states": state_ledger(cfg, r, d),
            "chunks": [predict_chunk(cfg, r, i) for i in range(cfg.num_chunks)],
            "schedule": activation_peak(cfg, r, leave_out=(CPU_RNG_STATE,))}


def case_on_this_rank(case: dict):
    """(MemoryConfig, grid) of one case in the running world (nccl: CUDA, else CPU)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    cfg = case_config(case, dist.get_world_size(), device)
    return cfg, _grid(cfg.tensor_model_parallel_size, cfg.context_parallel_size,
                      cfg.pipeline_model_parallel_size)


def measure_case(case: dict) -> dict:
    """Measured bytes of one case on this rank: states, each chunk, one schedule run."""
    cfg, grid = case_on_this_rank(case)
    states, chunks, ddps = measure_states(cfg, grid)
    # Activations: the smaller of two runs. On a loaded machine a gloo work object or the
    # cycle collector can hold a freed buffer a moment longer; that only ever adds bytes.
    acts = [min((measure_chunk(cfg, grid, chunk, i) for _ in range(2)), key=lambda m: m["kept"])
            for i, chunk in enumerate(chunks)]
    schedule = min((measure_schedule(cfg, grid, ddps) for _ in range(2)), key=lambda m: m["peak"])
    params = [[(n, p.numel()) for n, p in c.named_parameters()] for c in chunks]
    return {"case": case, "world_size": dist.get_world_size(), "device": cfg.device,
            "rank": dist.get_rank(),
            "pp_rank": grid.rank("pp"), "dp_cp_rank": grid.rank("dp_cp"), "states": states,
            "chunks": acts, "schedule": schedule, "params": params}


def measure_cases(cases: list[dict]) -> list[dict]:
    """measure_case for every case (all ranks run them in the same order)."""
    return [measure_case(c) for c in cases]
