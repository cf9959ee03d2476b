"""`[checkpoint] keep_latest_k`: after each save only the k newest iter_* directories stay, the
tracker's always among them, and nothing but iter_NNNNNNN directories is ever touched."""

from __future__ import annotations

import pytest


def _save(root, iterations, keep):
    from tinytron.checkpoint.resume import CheckpointConfig, CheckpointManager, _train_state_class
    from tinytron.model import GPTModel, tiny_config

    model = GPTModel(tiny_config(num_layers=1))
    manager = CheckpointManager(CheckpointConfig(save=str(root), keep_latest_k=keep,
                                                 no_save_rng=True), model.grid)
    for it in iterations:
        state = _train_state_class()()
        state.iteration = it
        manager.save(state, model)
    manager.comm.destroy()


def test_three_saves_keep_the_two_newest_and_the_tracker_names_one_of_them(tmp_path):
    from tinytron.checkpoint.formats import read_tracker

    (tmp_path / "notes").mkdir()
    (tmp_path / "iter_12").mkdir()  # not the iter_ + 7 digits form: not a save, kept
    _save(tmp_path, [1, 2, 3], keep=2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["iter_0000002", "iter_0000003", "iter_12", "notes"]
    assert read_tracker(tmp_path) == (3, False)


def test_the_tracker_iteration_is_kept_whatever_k_says(tmp_path):
    from tinytron.checkpoint.formats import rotate_checkpoints, write_tracker

    for it in (1, 2, 3):
        (tmp_path / f"iter_{it:07d}").mkdir()
    write_tracker(tmp_path, 1)  # e.g. a ckpt_step rewind: the tracker names the oldest
    rotate_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001", "iter_0000003", "latest_checkpointed_iteration.txt"]


def test_keep_latest_k_is_checked():
    from tinytron.checkpoint.resume import CheckpointConfig

    with pytest.raises(ValueError, match="keep_latest_k must be >= 0"):
        CheckpointConfig(keep_latest_k=-1)
