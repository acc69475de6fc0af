"""The GRPO loss runs the LM head only on the positions that predict trained tokens (a bool
``logits_to_keep``); the logprobs and the gradients must be those of the full computation."""

import pytest
import torch

from closedloop.trainers.grpo import _forward_keeps_masked_logits, policy_logits, policy_logprobs, predicting_positions
from closedloop.trainers.losses import token_logprobs


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[2, 10:] = 0  # a right-padded row
    mask = torch.zeros(3, 12)
    mask[0, 5:9] = 1
    mask[1, 7:12] = 1  # rows start training at different columns
    mask[2, 3:5] = 1
    mask[2, 7:10] = 1  # two turns with a tool reply between them
    return ids, attn, mask


@pytest.mark.parametrize("masked_head", [True, False], ids=["head-on-trained-positions", "full-logits-fallback"])
def test_kept_logits_give_the_full_logprobs_and_gradients(tiny_model_path, masked_head, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert _forward_keeps_masked_logits(type(model))  # transformers' own slicing: the fast path is taken
    if not masked_head:
        monkeypatch.setattr("closedloop.trainers.grpo._keeps_masked_logits", lambda m: False)
    ids, attn, mask = _batch(model.config.vocab_size)

    full = token_logprobs(model(input_ids=ids, attention_mask=attn).logits.float(), ids, 0.7)
    (-(full * mask).sum()).backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    logits = policy_logits(model, ids, attn, mask)
    assert logits.shape == (int(mask.sum()), model.config.vocab_size)  # the head ran on 13 of 36 positions
    kept = policy_logprobs(logits, ids, mask, 0.7)
    assert kept.shape == full.shape
    on = mask.bool()
    assert torch.allclose(kept[on], full[on], atol=1e-5)
    assert torch.count_nonzero(kept[~on]) == 0
    (-(kept * mask).sum()).backward()
    for name, p in model.named_parameters():
        if name in full_grads:
            assert torch.allclose(p.grad, full_grads[name], atol=1e-5), name


def test_position_t_minus_1_predicts_token_t():
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1]])
    assert predicting_positions(mask).tolist() == [[False, True, True, False], [False, False, True, False]]


def test_a_batch_with_nothing_to_train_gives_zero_logprobs():
    mask = torch.zeros(2, 6)
    logits = torch.randn(0, 9)
    out = policy_logprobs(logits, torch.randint(0, 9, (2, 6)), mask, 1.0)
    assert out.shape == (2, 6) and torch.count_nonzero(out) == 0
