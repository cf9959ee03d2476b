"""08 · Reliability, observability and the full-iteration CUDA graph."""

from tinytron.reliability.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION, EXIT_CODE_RESUME_TO_DISAMBIGUATE, RerunDataIterator,
    RerunDiagnostic, RerunMode, RerunState, RerunValidationStatus, compare_floats)
from tinytron.reliability.rerun_diagnoses import RerunStateMachine
from tinytron.reliability.result_checks import (RerunConfig, RerunErrorInjector,
                                                build_rerun_state_machine, check_grad_norms,
                                                check_loss, checked_loss_func,
                                                get_skipped_iterations_from_tracker_file)
from tinytron.reliability.fault_injection import Fault, FaultInjector, parse_fault
from tinytron.reliability.fault_tolerance import (EXIT_CODE_HANG_DETECTED, FaultToleranceConfig,
                                                  RankMonitor)
from tinytron.reliability.restarts import DistributedSignalHandler, inprocess_restart
from tinytron.reliability.loop_hooks import Reliability, ReliabilityConfig
from tinytron.reliability.timers import Timer, Timers
from tinytron.reliability.observability import (LoggingConfig, MetricsLogger, ProgressBar,
                                                memory_report, read_tensorboard_scalars)
from tinytron.reliability.full_cuda_graph import FullCudaGraphUnavailable, FullCudaGraphWrapper

__pages__ = ["long_run", "rerun_state_machine", "rerun_diagnoses", "result_checks", "fault_injection",
             "fault_tolerance", "restarts", "loop_hooks", "timers", "observability", "trace", "full_cuda_graph"]

__all__ = ["EXIT_CODE_FAILED_ON_RESULT_VALIDATION", "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
           "RerunDataIterator", "RerunDiagnostic", "RerunMode", "RerunState", "RerunStateMachine",
           "RerunValidationStatus", "compare_floats", "RerunConfig", "RerunErrorInjector",
           "build_rerun_state_machine", "check_grad_norms", "check_loss", "checked_loss_func",
           "get_skipped_iterations_from_tracker_file", "Fault", "FaultInjector", "parse_fault",
           "EXIT_CODE_HANG_DETECTED", "FaultToleranceConfig", "RankMonitor",
           "DistributedSignalHandler", "Reliability", "ReliabilityConfig", "inprocess_restart",
           "Timer", "Timers", "LoggingConfig", "MetricsLogger", "ProgressBar", "memory_report",
           "read_tensorboard_scalars", "FullCudaGraphUnavailable", "FullCudaGraphWrapper"]
