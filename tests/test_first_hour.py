"""A new user's first hour: no silent wrong results, and a one-line error for every bad input."""

from __future__ import annotations

import inspect
import json
import os
import pydoc
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
from tinytron.data import (DataConfig, GPTDatasetConfig, IndexedDataset, IndexedDatasetBuilder,
                           parse_data_path)
from tinytron.data.gpt_dataset import parse_and_normalize_split
from tinytron.data.indexed import get_bin_path, get_idx_path
from tinytron.launch import RankError, run_on_ranks
from tinytron.model import GPTModel, ModelConfig, tiny_config
from tinytron.optimizer import (AdamW, DistributedOptimizer, MixedPrecisionOptimizer,
                                OptimizerConfig, SchedulerConfig)
from tinytron.parallel import ParallelGrid

# -- 1. silent wrong results -------------------------------------------------------------------


def _ddp(use_distributed_optimizer: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer)
    return model, DistributedDataParallel(model, ParallelGrid.single(), cfg)


@pytest.mark.parametrize("distributed", [True, False], ids=["DistributedOptimizer", "plain"])
def test_step_refuses_grads_whose_sync_has_not_finished(distributed):
    model, ddp = _ddp(distributed)
    inner = AdamW(model.parameters(), lr=1e-2)
    opt = DistributedOptimizer(inner, ddp) if distributed else MixedPrecisionOptimizer(inner)
    before = [p.detach().clone() for p in model.parameters()]
    ddp.zero_grad_buffer()
    ddp(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="finish_grad_sync") as err:
        opt.step()
    assert "\n" not in str(err.value)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "it stepped anyway"
    ddp.finish_grad_sync()
    assert opt.step()[0]
    ddp(torch.randn(2, 4)).sum().backward()  # more grads after the sync: unreduced again
    with pytest.raises(RuntimeError, match="finish_grad_sync"):
        opt.step()
    ddp.zero_grad_buffer()  # a fresh iteration with nothing accumulated is fine
    assert opt.step()[0]


def test_token_and_label_ids_outside_the_vocabulary_are_refused():
    cfg = tiny_config(seq_length=8)
    model = GPTModel(cfg)
    ok = torch.zeros(2, 8, dtype=torch.long)
    bad = ok.clone()
    bad[1, 3] = cfg.vocab_size + 5
    with pytest.raises(ValueError, match=rf"input_ids.*{cfg.vocab_size + 5}.*vocab_size"):
        model(bad)  # was an opaque IndexError deep inside F.embedding
    with pytest.raises(ValueError, match=rf"labels.*{cfg.vocab_size + 5}.*vocab_size"):
        model(ok, labels=bad)  # was a finite, meaningless loss
    neg = ok.clone()
    neg[0, 0] = -3
    with pytest.raises(ValueError, match="-3"):
        model(ok, labels=neg)
    assert torch.isfinite(model(ok, labels=ok)).all()


def test_get_batch_checks_ids_against_the_tokenizer_size():
    from tinytron.data.distribute import get_batch

    s = 8
    batch = {"tokens": torch.full((1, s), 300), "labels": torch.full((1, s), 7),
             "loss_mask": torch.ones(1, s), "position_ids": torch.arange(s)[None],
             "attention_mask": torch.zeros(1, 1, s, s, dtype=torch.bool)}
    grid = ParallelGrid.single()
    with pytest.raises(ValueError, match="tokens.*300.*262"):
        get_batch(iter([batch]), grid, micro_batch_size=1, seq_length=s, vocab_size=262)
    batch["tokens"] = torch.full((1, s), 261)
    out = get_batch(iter([batch]), grid, micro_batch_size=1, seq_length=s, vocab_size=262)
    assert int(out["tokens"].max()) == 261


def test_an_attention_mask_that_masks_everything_is_refused():
    model = GPTModel(tiny_config(seq_length=8))
    tokens = torch.zeros(2, 8, dtype=torch.long)
    keep_all_hf_style = torch.ones(2, 1, 8, 8, dtype=torch.bool)  # Hugging Face: 1 = keep
    with pytest.raises(ValueError, match="True = masked"):
        model(tokens, attention_mask=keep_all_hf_style, labels=tokens)
    causal = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1).expand(2, 1, 8, 8)
    assert torch.isfinite(model(tokens, attention_mask=causal, labels=tokens)).all()


@pytest.mark.parametrize("value", [70000, -1])
def test_builder_refuses_ids_its_dtype_cannot_hold(tmp_path, value):
    builder = IndexedDatasetBuilder(get_bin_path(tmp_path / "x"), dtype=np.uint16)
    with pytest.raises(ValueError, match=rf"{value}.*uint16"):
        builder.add_item([1, value, 2])  # was silently wrapped (70000 -> 4464, -1 -> 65535)
    with pytest.raises(ValueError, match=rf"{value}.*uint16"):
        builder.add_document(np.array([value, 3]), [2])
    builder.add_item([0, 65535])
    builder.end_document()
    builder.finalize(get_idx_path(tmp_path / "x"))
    assert IndexedDataset(str(tmp_path / "x"))[0].tolist() == [0, 65535]


def test_a_data_path_string_is_split_on_whitespace():
    assert parse_data_path("0.3 a 0.7 b") == (["a", "b"], [0.3, 0.7])
    assert parse_data_path("prefix") == (["prefix"], None)
    assert DataConfig(data_path="prefix").blend() == ((["prefix"], None), None)
    assert DataConfig(data_path="0.3 a\n0.7 b").blend() == ((["a", "b"], [0.3, 0.7]), None)
    per_split = DataConfig(train_data_path="a b", valid_data_path="c").blend()
    assert per_split == (None, [(["a", "b"], None), (["c"], None), None])


@pytest.mark.parametrize("text", ["90,5,5", "90/5/5", "90 5 5", "90:5:5", "90, 5 ,5"])
def test_megatron_split_strings_take_any_separator(text):
    assert parse_and_normalize_split(text) == pytest.approx([0.9, 0.05, 0.05])

# -- 2. one-line errors naming the field, file or flag -----------------------------------------


def _hf_folder_missing(tmp_path, field):
    from tinytron.model.hf import hf_config_dict

    hf = hf_config_dict(tiny_config())
    del hf[field]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def _load_hf(folder):
    from tinytron.model import load_hf_llama

    return load_hf_llama(folder)


BAD_INPUTS = {
    # the silent ones: accepted before, misbehaved later
    "tie_embeddings='no'": (lambda tmp: tiny_config(tie_embeddings="no"), "tie_embeddings"),
    "use_distributed_optimizer='yes'": (
        lambda tmp: OptimizerConfig(lr=1e-3, use_distributed_optimizer="yes"),
        "use_distributed_optimizer"),
    "clip_grad='1.0'": (lambda tmp: OptimizerConfig(lr=1e-3, clip_grad="1.0"), "clip_grad"),
    "eod_id='0'": (lambda tmp: GPTDatasetConfig(sequence_length=8, eod_id="0"), "eod_id"),
    # the deep ones: failed 13 frames down, or not at all
    "sequence_length='512'": (lambda tmp: GPTDatasetConfig(sequence_length="512"), "sequence_length"),
    "sequence_length=32.0": (lambda tmp: GPTDatasetConfig(sequence_length=32.0), "sequence_length"),
    "random_seed=None": (lambda tmp: GPTDatasetConfig(sequence_length=8, random_seed=None),
                         "random_seed"),
    "mid_level_dataset_surplus=-1": (
        lambda tmp: GPTDatasetConfig(sequence_length=8, mid_level_dataset_surplus=-1.0),
        "mid_level_dataset_surplus"),
    "split='a,b'": (lambda tmp: GPTDatasetConfig(sequence_length=8, split="a,b"), "split"),
    "split='-1,2'": (lambda tmp: GPTDatasetConfig(sequence_length=8, split="-1,2"), "split"),
    "split='1,1,1,1'": (lambda tmp: GPTDatasetConfig(sequence_length=8, split="1,1,1,1"), "split"),
    "blend=('p',)": (lambda tmp: GPTDatasetConfig(sequence_length=8, blend=("p",)), "blend"),
    "blend=('p', None)": (lambda tmp: GPTDatasetConfig(sequence_length=8, blend=("p", None)),
                          "blend"),
    "blend weights 1 for 2 prefixes": (
        lambda tmp: GPTDatasetConfig(sequence_length=8, blend=(["a", "b"], [1.0])), "blend"),
    "blend weight 'x'": (
        lambda tmp: GPTDatasetConfig(sequence_length=8, blend=(["a", "b"], [1.0, "x"])), "blend"),
    "blend_per_split of 2": (
        lambda tmp: GPTDatasetConfig(sequence_length=8, blend_per_split=[(["a"], None)] * 2),
        "blend_per_split"),
    "DataConfig num_workers=-1": (lambda tmp: DataConfig(data_path="a", num_workers=-1),
                                  "num_workers"),
    "DataConfig num_workers='2'": (lambda tmp: DataConfig(data_path="a", num_workers="2"),
                                   "num_workers"),
    "DataConfig dataloader_type": (lambda tmp: DataConfig(data_path="a", dataloader_type="random"),
                                   "dataloader_type"),
    "DataConfig data_path=3": (lambda tmp: DataConfig(data_path=3), "data_path"),
    "DataConfig split=90": (lambda tmp: DataConfig(data_path="a", split=90), "split"),
    "DataConfig eod_mask_loss='yes'": (lambda tmp: DataConfig(data_path="a", eod_mask_loss="yes"),
                                       "eod_mask_loss"),
    "parse_data_path odd weights": (lambda tmp: parse_data_path("0.3 a 0.7"), "data-path"),
    "lr='3e-4'": (lambda tmp: OptimizerConfig(lr="3e-4"), "lr"),
    "lr=-1": (lambda tmp: OptimizerConfig(lr=-1.0), "lr"),
    "adam_beta2=1.5": (lambda tmp: OptimizerConfig(lr=1e-3, adam_beta2=1.5), "adam_beta2"),
    "adam_eps=0": (lambda tmp: OptimizerConfig(lr=1e-3, adam_eps=0.0), "adam_eps"),
    "weight_decay=None": (lambda tmp: OptimizerConfig(lr=1e-3, weight_decay=None), "weight_decay"),
    "hysteresis=0": (lambda tmp: OptimizerConfig(lr=1e-3, hysteresis=0), "hysteresis"),
    "optimizer_offload_fraction=2": (
        lambda tmp: OptimizerConfig(lr=1e-3, optimizer_offload_fraction=2.0),
        "optimizer_offload_fraction"),
    "muon_scale_mode": (lambda tmp: OptimizerConfig(lr=1e-3, muon_scale_mode="x"),
                        "muon_scale_mode"),
    "lr_decay_style": (lambda tmp: SchedulerConfig(lr_decay_style="cosin"), "lr_decay_style"),
    "lr_warmup_iters=-5": (lambda tmp: SchedulerConfig(lr_warmup_iters=-5), "lr_warmup_iters"),
    "lr_warmup_fraction=1.5": (lambda tmp: SchedulerConfig(lr_warmup_fraction=1.5),
                               "lr_warmup_fraction"),
    "lr_decay_iters='100'": (lambda tmp: SchedulerConfig(lr_decay_iters="100"), "lr_decay_iters"),
    "weight_decay_incr_style": (lambda tmp: SchedulerConfig(weight_decay_incr_style="up"),
                                "weight_decay_incr_style"),
    "bucket_size='1000'": (lambda tmp: DistributedDataParallelConfig(bucket_size="1000"),
                           "bucket_size"),
    "bucket_size=0": (lambda tmp: DistributedDataParallelConfig(bucket_size=0), "bucket_size"),
    "grad_reduce_in_fp32='true'": (
        lambda tmp: DistributedDataParallelConfig(grad_reduce_in_fp32="true"), "grad_reduce_in_fp32"),
    "dropout='0.1'": (lambda tmp: tiny_config(dropout="0.1"), "dropout"),
    "norm_epsilon='1e-5'": (lambda tmp: tiny_config(norm_epsilon="1e-5"), "norm_epsilon"),
    "init_std=None": (lambda tmp: tiny_config(init_std=None), "init_std"),
    "sequence_parallel=1": (lambda tmp: tiny_config(sequence_parallel=1), "sequence_parallel"),
    "hidden_size=64.0": (lambda tmp: tiny_config(hidden_size=64.0), "hidden_size"),
    "config.json without num_hidden_layers": (
        lambda tmp: _load_hf(_hf_folder_missing(tmp, "num_hidden_layers")), "num_hidden_layers"),
    "config.json without vocab_size": (
        lambda tmp: _load_hf(_hf_folder_missing(tmp, "vocab_size")), "vocab_size"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gives_one_line_naming_the_field(name, tmp_path):
    build, field = BAD_INPUTS[name]
    with pytest.raises(ValueError) as err:
        build(tmp_path)
    message = str(err.value)
    assert field in message, f"{name}: the error does not name {field!r}: {message}"
    assert "\n" not in message.strip(), f"{name}: more than one line: {message!r}"


def test_config_fields_are_documented_for_help():
    for cls, phrase in ((OptimizerConfig, "Peak learning rate"), (ModelConfig, "RMSNorm epsilon"),
                        (GPTDatasetConfig, "Tokens per sample"), (DataConfig, "--data-path"),
                        (SchedulerConfig, "Warmup iterations"),
                        (DistributedDataParallelConfig, "Elements per bucket")):
        assert phrase in (cls.__doc__ or ""), f"{cls.__name__}.__doc__ lacks its field docs"
        assert phrase in pydoc.render_doc(cls, renderer=pydoc.plaintext)



def test_every_public_class_has_a_docstring_for_help():
    """help() on any public class shows a docstring (mixins included)."""
    import importlib
    import pkgutil

    import tinytron
    missing = []
    for info in pkgutil.walk_packages(tinytron.__path__, "tinytron."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and obj.__module__ == module.__name__
                    and not name.startswith("_") and not (obj.__doc__ or "").strip()):
                missing.append(f"{info.name}.{name}")
    assert not missing, f"classes whose help() shows no docstring: {missing}"

# -- 3. the command line -----------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 20, "title": f"t{i}"}) + "\n"
                            for i in range(12)))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "not_a_tokenizer.json").write_text('{"hello": "world"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


CLI_BAD = {
    "--workers 0": (["--input", "{d}/docs.jsonl", "--workers", "0"], "--workers"),
    "--partitions 0": (["--input", "{d}/docs.jsonl", "--partitions", "0"], "--partitions"),
    "--vocab-size abc": (["--input", "{d}/docs.jsonl", "--vocab-size", "abc"], "--vocab-size"),
    "unknown flag": (["--input", "{d}/docs.jsonl", "--frobnicate"], "--frobnicate"),
    "byte tokenizer with a file": (
        ["--input", "{d}/docs.jsonl", "--tokenizer-file", "{d}/tokenizer.json"], "--tokenizer-file"),
    "hf without a file": (["--input", "{d}/docs.jsonl", "--tokenizer-type", "hf"],
                          "--tokenizer-file"),
    "hf with a non-tokenizer file": (
        ["--input", "{d}/docs.jsonl", "--tokenizer-type", "hf", "--tokenizer-file",
         "{d}/not_a_tokenizer.json"], "not_a_tokenizer.json"),
    "missing input": (["--input", "{d}/nope.jsonl"], "nope.jsonl"),
    "bad JSON line": (["--input", "{d}/bad.jsonl"], "bad.jsonl:2"),
    "missing JSON key": (["--input", "{d}/docs.jsonl", "--json-keys", "body"], "'body'"),
    "BPE below 258": (["--input", "{d}/docs.jsonl", "--tokenizer-type", "bpe", "--vocab-size",
                       "100"], "--vocab-size"),
    "merge a missing prefix": (["--merge", "{d}/nope"], "nope"),
}


@pytest.mark.parametrize("name", list(CLI_BAD))
def test_preprocess_bad_input_is_one_line_with_exit_code_2(name, corpus, capsys):
    from tinytron.data.preprocess import main

    args, needle = CLI_BAD[name]
    argv = [a.format(d=corpus) for a in args] + ["--output-prefix", str(corpus / "out"),
                                                 "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, f"{name}: not one line:\n{err}"
    assert err.startswith("tinytron-preprocess: error:") and needle in err, err


def test_preprocess_as_a_module_runs_the_command_not_the_demo(corpus):
    """`python -m tinytron.data.preprocess ARGS` is the command line (Megatron's habit)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bad = subprocess.run([sys.executable, "-m", "tinytron.data.preprocess", "--input",
                          str(corpus / "docs.jsonl"), "--output-prefix", str(corpus / "o"),
                          "--workers", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "tinytron-preprocess: error: --workers must be >= 1, got 0"]
    good = subprocess.run([sys.executable, "-m", "tinytron.data.preprocess", "--input",
                           str(corpus / "docs.jsonl"), "--output-prefix", str(corpus / "o"),
                           "--workers", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert good.returncode == 0, good.stderr
    assert (corpus / "o_text_document.idx").exists() and "BPE" not in good.stdout


def test_preprocess_help_keys_and_summary(corpus, capsys):
    from tinytron.data.preprocess import main, run

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert "(default: 4096)" in " ".join(capsys.readouterr().out.split())
    prefixes = run(["--input", str(corpus / "docs.jsonl"), "--json-keys", "text", "title",
                    "--output-prefix", str(corpus / "k"), "--workers", "1", "--no-progress"])
    assert prefixes == [str(corpus / "k_text_document"), str(corpus / "k_title_document")]
    assert IndexedDataset(prefixes[1]).document_count == 12
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "vocab 262" in last and "eod 256" in last and "pad 257" in last, last
    run(["--input", str(corpus / "docs.jsonl"), "--output-prefix", str(corpus / "b"),
         "--tokenizer-type", "bpe", "--vocab-size", "5000", "--workers", "1", "--no-progress"])
    captured = capsys.readouterr()
    assert "warning: the BPE vocabulary has" in captured.err and "5000" in captured.err


# -- 4. launch, export, conveniences -----------------------------------------------------------


def fail_on_rank_one():
    """Rank 1 raises; rank 0 waits in a barrier for it and fails only because rank 1 left."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("the root cause")
    dist.barrier()


def test_rank_error_first_line_names_the_root_cause():
    with pytest.raises(RankError) as err:
        run_on_ranks(fail_on_rank_one, 2, timeout=60)
    first = str(err.value).splitlines()[0]
    assert "rank 1" in first and "ValueError: the root cause" in first, first
    assert err.value.root_rank == 1


def test_hf_export_carries_the_tokenizer(tmp_path):
    from tinytron.data.preprocess import train_bpe_tokenizer
    from tinytron.model import load_hf_llama, save_hf_llama

    texts = [f"the quick brown fox {i} jumps" for i in range(50)]
    tok_file = train_bpe_tokenizer(iter(texts), 300, tmp_path / "tok.json")
    model = GPTModel(tiny_config())
    save_hf_llama(model, tmp_path / "hf", tokenizer_file=tok_file)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["eos_token_id"] == 0 and (tmp_path / "hf" / "tokenizer.json").exists()
    loaded, _ = load_hf_llama(tmp_path / "hf")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters()))
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    from tokenizers import Tokenizer

    assert auto.encode("the quick fox") == Tokenizer.from_file(tok_file).encode("the quick fox").ids
    assert auto.eos_token_id == 0


def test_datasets_have_a_readable_repr(tmp_path):
    from tinytron.data import GPTDataset, Split

    prefix = str(tmp_path / "r")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for n in (5, 7, 9):
        builder.add_item(np.arange(n))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    indexed = IndexedDataset(prefix)
    text = repr(indexed)
    assert prefix in text and "documents=3" in text and "tokens=21" in text, text
    cfg = GPTDatasetConfig(sequence_length=4, split="100,0,0", path_to_cache=str(tmp_path / "c"))
    ds = GPTDataset(indexed, prefix, np.arange(3, dtype=np.int32), 4, Split.train, cfg)
    text = repr(ds)
    assert "split=train" in text and f"samples={len(ds)}" in text and prefix in text, text


def test_public_entry_points_show_a_usage_example():
    from tinytron import data, launch, model, optimizer
    from tinytron.buffers import DistributedDataParallel
    from tinytron.data import preprocess

    entry_points = [launch.run_on_ranks, model.GPTModel, model.save_hf_llama, model.load_hf_llama,
                    data.IndexedDataset, data.IndexedDatasetBuilder, data.GPTDataset,
                    data.build_train_valid_test_datasets, data.build_data_iterators,
                    data.get_batch, data.parse_data_path, preprocess.main,
                    DistributedDataParallel, optimizer.DistributedOptimizer,
                    optimizer.get_megatron_optimizer]
    # inspect.getdoc is what help() and IDEs show
    missing = [f.__qualname__ for f in entry_points if "Example" not in (inspect.getdoc(f) or "")]
    assert not missing, f"no usage example in the docstring of {missing}"


def test_book_titles_keep_the_text_of_code_spans():
    sys.path.insert(0, str(ROOT / "book"))
    try:
        import hooks
    finally:
        sys.path.pop(0)
    assert (hooks.code_span_title(ROOT / "chapters" / "04_data" / "indexed.py")
            == "04 · Data: the .bin / .idx indexed dataset")
    assert hooks.code_span_title(ROOT / "chapters" / "index.md") is None  # no code: left alone
