"""01 · The main loop: pretrain / train / train_step / training_log and the pipeline schedules."""
