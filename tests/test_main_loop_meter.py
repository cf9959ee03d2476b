"""LiveBytesMeter: the CPU ruler every memory claim of the book is measured with."""

import torch

from tinytron.main_loop.memory_meter import LiveBytesMeter, saved_tensor_bytes, storage_bytes
from tinytron.model import GPTModel, tiny_config


def test_views_count_once_and_deletes_are_seen():
    with LiveBytesMeter() as m:
        x = torch.ones(1024)
        assert m.current == 4096
        y = x * 2
        v = y[:10]
        assert m.current == 8192 and m.peak == 8192
        del x
        assert m.current == 4096
        del y
        assert m.current == 4096  # the view keeps the storage alive
        del v
        assert m.current == 0
    assert m.peak == 8192


def test_in_place_and_pre_existing_tensors_are_not_counted_unless_tracked():
    w = torch.zeros(256)
    with LiveBytesMeter() as m:
        w.add_(1.0)
        _ = w.t()
        assert m.current == 0
        m.track([w, w[:3]])
        assert m.current == 1024


def test_gpt_forward_activations_match_the_saved_tensor_count():
    """After a forward, live bytes = the activations autograd saved (weights excluded) + the loss."""
    torch.manual_seed(0)
    cfg = tiny_config(seq_length=32)
    model = GPTModel(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    model(tokens, labels=tokens)  # fills the model's RoPE table cache (resident, like weights)
    tables = [t for pair in model._rope_cache.values() for t in pair]
    _, saved = saved_tensor_bytes(lambda: model(tokens, labels=tokens),
                                  exclude=[tokens, *model.parameters(), *tables])
    with LiveBytesMeter() as m:
        loss = model(tokens, labels=tokens)
        live = m.current - storage_bytes([loss])
        loss.sum().backward()
        del loss
        grads = m.current
    # two independent rulers: the dispatcher's storage table and autograd's saved-tensor hooks
    assert saved > 0 and live == saved, (live, saved)
    assert grads == storage_bytes(p.grad for p in model.parameters())
    assert m.peak >= live
