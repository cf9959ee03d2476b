"""Fine-tuning as a user does it: a Hugging Face Llama in, SFT on a chat JSONL, a Hugging Face
Llama out; then the same checkpoint evaluated only (`training.skip_train`).

Two trainer launches in all (one process each). Every check reads the run's own records: its
JSONL, its tracker, the exported folder (loaded by transformers).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

transformers = pytest.importorskip("transformers")

ANSWER_TOKENS = 6  # every answer is 5 bytes, plus the <|end|> that closes the turn


def _train(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tinytron.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]


def _write_chats(path: Path, n: int = 40) -> None:
    """Chats whose prompts differ in length (3..60 bytes) and whose answers are all 5 bytes."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            prompt = "why " * rng.randint(1, 15)
            f.write(json.dumps({"messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": f"ok {i % 10}!"}]}) + "\n")


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """from-hf (a random 2-layer Llama made for 256 positions) -> 3 SFT iterations at 128."""
    import torch

    from tinytron.checkpoint._hf_tokenizer import write_byte_tokenizer
    from tinytron.checkpoint.convert import main as convert

    tmp = tmp_path_factory.mktemp("finetune")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp / "hf")
    write_byte_tokenizer(tmp / "hf" / "tokenizer.json")
    (tmp / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    _write_chats(tmp / "chat.jsonl")
    assert convert(["from-hf", str(tmp / "hf"), str(tmp / "base")]) == 0
    run = tmp / "sft"
    proc = _train("--config", str(tmp / "base" / "config.toml"), "--data.sft", "true",
                  "--data.data_path", str(tmp / "chat.jsonl"), "--data.split", '"80,20,0"',
                  "--checkpoint.load", str(tmp / "base"), "--checkpoint.finetune", "true",
                  "--checkpoint.save", str(run), "--model.seq_length", "128",
                  "--training.train_iters", "3", "--training.global_batch_size", "4",
                  "--training.eval_interval", "2", "--training.eval_iters", "1",
                  "--training.log_interval", "1", "--optimizer.lr", "1e-3",
                  "--scheduler.lr_warmup_iters", "0", "--logging.progress_bar", "false",
                  "--data.num_workers", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, run, proc.stdout


def test_sft_trains_only_the_assistant_tokens(finetuned):
    _, run, out = finetuned
    assert "restored model weights only (checkpoint.finetune" in out
    records = _records(run)
    train = [r for r in records if r.get("type") == "train"]
    valid = [r for r in records if r.get("type") == "validation"]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert len(valid) == 2  # at 2, and the final one at 3
    # prompts of 3..60 bytes, answers of 5: if a prompt token carried a loss, the count would
    # move with the prompt; every sample of every step counts exactly the answer's tokens
    for r in train + valid:
        losses = r.get("losses") or r["validation"]
        assert losses["loss tokens per sample"] == ANSWER_TOKENS, r
        assert 0 < losses["lm loss"] < 10


def test_the_finetune_exports_to_a_llama_transformers_loads(finetuned):
    import torch

    from tinytron.checkpoint.convert import main as convert

    tmp, run, _ = finetuned
    assert convert(["to-hf", str(run), str(tmp / "out")]) == 0
    exported = json.loads((tmp / "out" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 256  # the model's, not the fine-tune's 128
    model = transformers.LlamaForCausalLM.from_pretrained(tmp / "out").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "out")
    assert tok("ok 1!").input_ids == list(b"ok 1!")  # the ids the model was trained on
    before = transformers.LlamaForCausalLM.from_pretrained(tmp / "hf").eval()
    ids = torch.tensor([list(b"why why")])
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, before(ids).logits)  # it was trained


def test_skip_train_evaluates_the_checkpoint_on_valid_and_test_and_exits_zero(finetuned):
    """README's command: load the run, write the evaluation elsewhere, train nothing."""
    tmp, run, _ = finetuned
    tracker, log = ((run / n).read_text() for n in ("latest_checkpointed_iteration.txt",
                                                     "log.jsonl"))
    proc = _train("--config", str(run / "config.toml"), "--training.skip_train", "true",
                  "--checkpoint.load", str(run), "--checkpoint.save", str(tmp / "eval"),
                  "--checkpoint.finetune", "false", "--data.split", '"60,20,20"',
                  "--training.train_iters", "none", "--logging.progress_bar", "false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = _records(tmp / "eval")
    assert [r["type"] for r in new] == ["start", "validation", "validation"]
    assert [r.get("split", "validation") for r in new[1:]] == ["validation", "test"]
    assert all(r["iteration"] == 3 and r["validation"]["loss tokens per sample"] == ANSWER_TOKENS
               for r in new[1:])
    assert (run / "latest_checkpointed_iteration.txt").read_text() == tracker  # nothing saved
    assert (run / "log.jsonl").read_text() == log
    assert not list((tmp / "eval").glob("iter_*"))
    assert "final test at iteration 3" in proc.stdout


@pytest.mark.parametrize("flags, needle", [
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "-3"], "--top-k must be >= 0"),
    (["--prompt", "x" * 200], "the prompt is 200 tokens, the model's seq_length 128"),
    (["--tokenizer-file", "{big}"], "the tokenizer has 300 ids but the model only 262"),
])
def test_generate_refuses_what_it_cannot_do_in_one_line(finetuned, flags, needle, capsys):
    from tinytron.model._generate import main

    tmp, run, _ = finetuned
    big = tmp / "big_tokenizer.json"
    if not big.exists():  # a tokenizer.json with more ids than the model has rows
        from tokenizers import Tokenizer, models
        vocab = {f"w{i}": i for i in range(299)} | {"<|endoftext|>": 299}
        Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(big))
    flags = [f.replace("{big}", str(big)) for f in flags]
    args = [str(run), "--prompt", "why", "--max-new-tokens", "5", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_without_the_bar_each_interval_is_megatrons_line_and_the_final_save_is_timed(finetuned):
    """progress_bar false: one log line per log_interval (1 here) on stdout; the final save's
    seconds are in TensorBoard at the last iteration (the save ran after the last record)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run, out = finetuned
    lines = [x for x in out.splitlines() if x.startswith(" iteration ")]
    assert [int(x.split("/")[0].split()[-1]) for x in lines] == [1, 2, 3], out[-3000:]
    assert all("lm loss:" in x and "loss tokens per sample: 6.000000E+00" in x for x in lines)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    saves = [e.step for e in events.Scalars("save-checkpoint-time")]
    assert saves == [3], saves
