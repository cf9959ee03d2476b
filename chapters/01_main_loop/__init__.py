"""01 · The main loop: pretrain / train / train_step / training_log and the pipeline schedules."""

from tinytron.main_loop.memory_meter import LiveBytesMeter, saved_tensor_bytes, storage_bytes
