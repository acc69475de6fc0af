"""The GRPO loss runs the LM head only on the positions that predict trained tokens
(``logits_to_keep``); the logprobs and the gradients must be those of the full computation."""

import torch

from closedloop.trainers.grpo import _first_loss_column, policy_logits, policy_logprobs
from closedloop.trainers.losses import token_logprobs


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[2, 10:] = 0  # a right-padded row
    mask = torch.zeros(3, 12)
    mask[0, 5:9] = 1
    mask[1, 7:12] = 1  # rows start training at different columns
    mask[2, 6:10] = 1
    return ids, attn, mask


def test_kept_logits_give_the_full_logprobs_and_gradients(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids, attn, mask = _batch(model.config.vocab_size)
    start = _first_loss_column(mask)
    assert start == 5

    full = token_logprobs(model(input_ids=ids, attention_mask=attn).logits.float(), ids, 0.7)
    (-(full * mask).sum()).backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    logits = policy_logits(model, ids, attn, start)
    assert logits.shape[1] == ids.shape[1] - start + 1  # the head ran on 8 of 12 positions
    kept = policy_logprobs(logits, ids, start, 0.7)
    assert kept.shape == full.shape
    assert torch.allclose(kept[:, start:], full[:, start:], atol=1e-5)
    assert torch.count_nonzero(kept[:, :start]) == 0
    (-(kept * mask).sum()).backward()
    for name, p in model.named_parameters():
        if name in full_grads:
            assert torch.allclose(p.grad, full_grads[name], atol=1e-5), name


def test_a_batch_with_nothing_to_train_keeps_one_column():
    mask = torch.zeros(2, 6)
    assert _first_loss_column(mask) == 6
    logits = torch.randn(2, 1, 9)
    out = policy_logprobs(logits, torch.randint(0, 9, (2, 6)), 6, 1.0)
    assert out.shape == (2, 6) and torch.count_nonzero(out) == 0
