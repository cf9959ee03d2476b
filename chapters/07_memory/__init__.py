"""07 · The memory model: the ledger, how parallelism splits it, configuration search."""

from tinytron.memory.megatron_model import (NUM_BYTES_IN_MEGABYTE, megatron_args,
                                            megatron_param_counts,
                                            megatron_theoretical_memory)
from tinytron.memory.states import MemoryConfig, chunk_params, state_ledger
from tinytron.memory.activations import Saved, chunk_saved, layer_saved
from tinytron.memory.peak import activation_peak, schedule_ops
from tinytron.memory.ledger import (RankLedger, megatron_args_from, plot_ledgers, rank_ledger,
                                    stage_ledgers)
from tinytron.memory.calculator import (Hardware, memory_config_from, running_example,
                                        search_layouts)
# The pages 07.10 to 07.13 are the modules step_compute, step_overlap, step_offload and
# step_time; step_time re-exports the names of the first three (the calculator's own
# step_time function stays tinytron.memory.calculator.step_time).
from tinytron.memory.step_time import (Links, StepOptions, StepTime, best_offload_modules,
                                       estimate_step, offload_table)
from tinytron.memory._step_time_io import step_timeline

__pages__ = ["megatron_model", "states", "activations", "peak", "ledger", "measured",
             "megatron_gap", "config_ledger", "calculator", "step_compute", "step_overlap",
             "step_offload", "step_time", "step_published"]

__all__ = ["NUM_BYTES_IN_MEGABYTE", "megatron_args", "megatron_param_counts",
           "megatron_theoretical_memory", "MemoryConfig", "chunk_params", "state_ledger", "Saved",
           "activation_peak", "chunk_saved", "layer_saved", "schedule_ops", "RankLedger",
           "megatron_args_from", "plot_ledgers", "rank_ledger", "stage_ledgers", "Hardware",
           "memory_config_from", "running_example", "search_layouts", "Links", "StepOptions",
           "StepTime", "best_offload_modules", "estimate_step", "offload_table", "step_timeline"]
