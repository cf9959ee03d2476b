"""Appendix B: Hugging Face Llama import/export — round trip, bad checkpoints, transformers parity."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinytron.model.config import tiny_config
from tinytron.model.gpt import GPTModel
from tinytron.model.hf import load_hf_llama, save_hf_llama


@pytest.fixture()
def exported(tmp_path):
    config = tiny_config(seed=5, tie_embeddings=False)
    model = GPTModel(config)
    save_hf_llama(model, tmp_path)
    return model, config, tmp_path


def test_export_import_is_bit_identical(exported):
    model, config, folder = exported
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" in tensors and "model.layers.1.self_attn.q_proj.weight" in tensors
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    hf = json.loads((folder / "config.json").read_text())
    assert hf["num_key_value_heads"] == 2 and hf["tie_word_embeddings"] is False
    loaded, loaded_config = load_hf_llama(folder)
    assert loaded_config.replace(seed=config.seed) == config
    for (n, a), (m, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    save_hf_llama(loaded, folder / "again")
    again = load_file(folder / "again" / "model.safetensors")
    assert all(torch.equal(again[k], tensors[k]) for k in tensors) and set(again) == set(tensors)


def test_tied_export_has_no_lm_head(tmp_path):
    save_hf_llama(GPTModel(tiny_config()), tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("damage, name", [
    ("drop", "model.layers.1.mlp.up_proj.weight"),
    ("reshape", "model.layers.0.self_attn.v_proj.weight"),
    ("extra", "model.layers.7.mlp.gate_proj.weight"),
    ("nan", "model.norm.weight"),
])
def test_bad_checkpoint_names_the_tensor(exported, damage, name):
    _, _, folder = exported
    tensors = load_file(folder / "model.safetensors")
    if damage == "drop":
        del tensors[name]
    elif damage == "reshape":
        tensors[name] = tensors[name][:-1].clone()
    elif damage == "extra":
        tensors[name] = torch.zeros(2)
    else:
        tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_hf_llama(folder)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_unsupported_config_is_refused(exported, key):
    """Llama-3.1's scaled RoPE is refused in transformers' 4.x key and in its 5.x key alike."""
    _, _, folder = exported
    hf = json.loads((folder / "config.json").read_text())
    hf[key] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=f"{key}.rope_type='llama3' is not supported"):
        load_hf_llama(folder)
    hf[key] = {"type": "linear", "factor": 2.0}   # transformers' older spelling of the type
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=f"{key}.rope_type='linear'"):
        load_hf_llama(folder)
    with pytest.raises(ValueError, match="config.json"):
        load_hf_llama(folder / "nowhere")


def test_logits_match_transformers_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, attn_implementation="eager")
    reference = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # HF inits norms to 1; perturb them so the test sees their mapping
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)
    model, _ = load_hf_llama(tmp_path / "hf")
    tokens = torch.randint(0, 512, (2, 48))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model(tokens)
    print(f"max |logits - transformers logits| = {float((got - expected).abs().max()):.2e}")
    assert torch.allclose(got, expected, atol=2e-5, rtol=1e-4), float((got - expected).abs().max())
    # ... and the other way: our export loads into transformers with the same logits.
    save_hf_llama(model, tmp_path / "ours")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours",
                                                         attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.allclose(back(tokens).logits, expected, atol=2e-5, rtol=1e-4)


def test_multi_file_checkpoint_loads(exported):
    model, _, folder = exported
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    (folder / "model.safetensors").unlink()
    save_file({k: tensors[k] for k in names[::2]}, folder / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in names[1::2]}, folder / "model-00002-of-00002.safetensors")
    loaded, _ = load_hf_llama(folder)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))


def _llama_500k(transformers, tmp_path):
    """A random transformers Llama with rope_theta 500000, saved by transformers itself."""
    torch.manual_seed(1)
    hf_config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="eager")
    reference = transformers.LlamaForCausalLM(hf_config).eval()
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return reference


def _as_transformers_4(folder):
    """Rewrite config.json as transformers 4.x writes it: rope_theta on top, rope_scaling null."""
    hf = json.loads((folder / "config.json").read_text())
    theta = hf.pop("rope_parameters", {}).get("rope_theta", hf.get("rope_theta"))
    hf.update(rope_theta=theta, rope_scaling=None, transformers_version="4.57.1")
    (folder / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("layout", ["transformers-5", "transformers-4"])
def test_rope_theta_of_both_config_layouts_round_trips_through_the_converter(tmp_path, layout):
    """from-hf keeps rope_theta (either layout): transformers' logits; to-hf writes it back."""
    transformers = pytest.importorskip("transformers")
    from tinytron.checkpoint.convert import main as convert

    reference = _llama_500k(transformers, tmp_path)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    if layout == "transformers-5":
        if int(transformers.__version__.split(".")[0]) < 5:
            pytest.skip("transformers < 5 writes the 4.x layout")
        assert hf["rope_parameters"]["rope_theta"] == 500000.0 and "rope_theta" not in hf
    else:
        _as_transformers_4(tmp_path / "hf")
    model, config = load_hf_llama(tmp_path / "hf")
    assert config.rotary_base == 500000
    tokens = torch.randint(0, 512, (2, 48))
    with torch.no_grad():
        expected = reference(tokens).logits
        assert torch.allclose(model(tokens), expected, atol=2e-5, rtol=1e-4)
    assert convert(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert convert(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == 500000.0
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out",
                                                         attn_implementation="eager").eval()
    assert back.config.rope_parameters["rope_theta"] == 500000.0
    with torch.no_grad():
        assert torch.allclose(back(tokens).logits, expected, atol=2e-5, rtol=1e-4)


def test_two_different_rope_bases_are_refused(exported):
    _, _, folder = exported
    hf = json.loads((folder / "config.json").read_text())
    hf.update(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="RoPE's base twice"):
        load_hf_llama(folder)
