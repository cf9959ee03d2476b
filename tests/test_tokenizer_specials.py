"""A Llama-style tokenizer (`<s>` BOS, `</s>` end of document, `<pad>`) from preprocessing to the
trainer's checks to the Hugging Face export: in process, no training launch."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    """A small BPE with Llama-2's specials and its post-processor that prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tmp = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 30]
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in text * 5))
    return tmp, path, corpus


def test_preprocess_names_eod_token_and_records_the_tokenizers_own_specials(llama_like, capsys):
    from tinytron.data._sidecar import read_sidecar
    from tinytron.data.preprocess import main

    tmp, path, corpus = llama_like
    args = ["--input", str(corpus), "--tokenizer-type", "hf", "--tokenizer-file", str(path),
            "--workers", "1", "--no-progress"]
    assert main([*args, "--output-prefix", str(tmp / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--eod-token" in err[0] and "'</s>'" in err[0], err
    assert main([*args, "--output-prefix", str(tmp / "data"), "--eod-token", "</s>"]) == 0
    info = read_sidecar(str(tmp / "data_text_document"))
    assert (info["eod"], info["pad"]) == (2, 3)  # </s> and <pad>, not -1


def test_the_trainer_takes_eod_from_the_data_or_its_tokenizer_key(llama_like):
    from tinytron.config import ConfigError
    from tinytron.train import resolve_config

    tmp, path, _ = llama_like
    base = ["--config", "configs/tiny.toml", "--tokenizer.tokenizer_type", "hf",
            "--tokenizer.tokenizer_model", str(path), "--model.vocab_size", "384",
            "--checkpoint.save", str(tmp / "run"), "--training.train_iters", "4",
            "--scheduler.lr_warmup_iters", "1"]
    data = ["--data.data_path", str(tmp / "data_text_document")]
    cfg = resolve_config([*base, *data], 2)  # the sidecar's EOD (2) is the tokenizer's </s>
    assert cfg.extra["tokenizer"].eod_token is None
    resolve_config([*base, *data, "--tokenizer.eod_token", "</s>"], 2)
    with pytest.raises(ConfigError, match="eod 2 .data. vs 1"):  # the data says 2, the key 1
        resolve_config([*base, *data, "--tokenizer.eod_token", "<s>"], 2)
    with pytest.raises(ConfigError, match="tokenizer.eod_token"):  # no data to say which
        resolve_config(base, 2)


def test_the_export_encodes_as_the_training_data_did(llama_like):
    from tinytron.data.preprocess import TokenizerSpec, build_tokenizer
    from tinytron.model import GPTModel, save_hf_llama, tiny_config

    tmp, path, _ = llama_like
    model = GPTModel(tiny_config(vocab_size=384, seq_length=32).replace(max_position_embeddings=64))
    save_hf_llama(model, tmp / "hf", tokenizer_file=str(path))
    ours = build_tokenizer(TokenizerSpec("hf", str(path), "</s>"))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp / "hf")
    text = "the lazy dog says hello"
    assert theirs(text).input_ids == ours.encode(text)  # no <s> in front: the data had none
    assert (theirs.eos_token, theirs.pad_token) == ("</s>", "<pad>")
    hf = json.loads((tmp / "hf" / "config.json").read_text())
    assert (hf["eos_token_id"], hf["max_position_embeddings"]) == (2, 64)


def test_preprocessing_a_chat_file_points_to_the_sft_mode(tmp_path, capsys):
    from tinytron.data.preprocess import main

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["--input", str(chat), "--json-keys", "messages", "--output-prefix",
                 str(tmp_path / "c"), "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--data.sft true" in err[0], err
