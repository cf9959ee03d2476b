"""01 · The main loop: pretrain / train / train_step / training_log and the pipeline schedules."""

from tinytron.main_loop.memory_meter import LiveBytesMeter, saved_tensor_bytes, storage_bytes
from tinytron.main_loop.schedules import (ScheduleConfig, ScheduleEvent, ScheduleRecorder,
                                          forward_backward_no_pipelining,
                                          forward_backward_pipelining_without_interleaving,
                                          get_forward_backward_func)
from tinytron.main_loop.virtual_stages import (check_interleaving, get_pp_rank_microbatches,
                                               get_schedule_table)
from tinytron.main_loop.interleaved import forward_backward_pipelining_with_interleaving
from tinytron.main_loop.microbatches import (ConstantNumMicroBatchesCalculator,
                                             StepBatchsizeNumMicroBatchesCalculator,
                                             build_num_microbatches_calculator, num_microbatches)
from tinytron.main_loop.training_log import (LogState, format_log_line,
                                             num_floating_point_operations,
                                             peak_flops_per_device, training_log)
from tinytron.main_loop.loop import (StepResult, TorchOptimizer, TrainState, evaluate,
                                     gpt_forward_step, train_step)
from tinytron.main_loop.run import TrainingRun, pretrain, train

# The loop comes first (one iteration, then the run): the pages after it open up its parts (batches, schedules, log, memory).
__pages__ = ["loop", "run", "microbatches", "pipeline_orders", "schedules", "virtual_stages",
             "interleaved", "schedule_timeline", "training_log", "memory_meter", "resident_flowing",
             "assembled", "host_syncs"]
