"""Golden tests: closedloop's losses equal TRL's on identical tensors, and masks stop every gradient.

TRL (a test extra) is the oracle: its GRPO and SFT loss methods are called on a minimal ``self``
(the attributes they read) instead of building whole trainers; TRL's own helpers
(``selective_log_softmax``, ``entropy_from_logits``, the fused LM head) are called directly.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from closedloop.messages import AssistantMessage, Trajectory, Turn
from closedloop.trainers.losses import (entropy_from_logits, grpo_loss, importance_sampling_weights, k3_kl,
                                        sft_loss, token_logprobs)

trl = pytest.importorskip("trl")
from trl import GRPOTrainer, SFTTrainer  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

torch.set_num_threads(1)


def tiny_qwen2(seed: int = 0, vocab: int = 64):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


# ---------------------------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_trl_selective_log_softmax(dtype, temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 9, 50).to(dtype)
    ids = torch.randint(0, 50, (3, 9))
    ours = token_logprobs(logits, ids, temperature=temperature)
    theirs = trl_utils.selective_log_softmax(logits[:, :-1], ids[:, 1:], temperature=temperature)
    assert torch.equal(ours[:, 0], torch.zeros(3, dtype=ours.dtype))
    torch.testing.assert_close(ours[:, 1:], theirs)
    naive = torch.log_softmax(logits[:, :-1].float() / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6  # bfloat16 keeps ~3 significant digits
    torch.testing.assert_close(ours[:, 1:].float(), naive, atol=1e-6, rtol=tol)


def test_token_logprobs_align_with_trl_fused_lm_head_on_a_model():
    """The shift is right: TRL's GRPO scores ``labels`` through a fused LM head; same numbers from full logits."""
    model = tiny_qwen2()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ours = token_logprobs(model(input_ids=ids).logits, ids, temperature=0.8)
        trl_utils.add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    torch.testing.assert_close(ours[:, 1:], out.log_probs, atol=1e-5, rtol=1e-5)


def test_entropy_equals_trl():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 33) * 3
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=3), trl_utils.entropy_from_logits(logits))


def test_token_logprobs_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


# -------------------------------------------------------------------------------------------------- GRPO


class _Accel:
    num_processes = 1

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def trl_grpo_loss(logps, old_logps, advantages, mask, *, ref_logps=None, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
                  loss_type="grpo", max_completion_length=None, is_ratio=None, num_items_in_batch=None, delta=None,
                  grad_accum=1, steps_per_generation=1, num_processes=1):
    """TRL's ``GRPOTrainer._compute_loss`` on a minimal ``self``; the model forward returns ``logps``."""
    B, T = logps.shape
    accel = _Accel()
    accel.num_processes = num_processes
    self = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, aux_loss_enabled=False, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=grad_accum,
        max_completion_length=max_completion_length or T, accelerator=accel, _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=steps_per_generation))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "old_per_token_logps": old_logps, "ref_per_token_logps": ref_logps,
              "importance_sampling_ratio": is_ratio}
    # TRL's num_items_in_batch: the loss-mask tokens of the generation batch across processes
    inputs["num_items_in_batch"] = mask.sum() if num_items_in_batch is None else torch.tensor(float(num_items_in_batch))
    loss = GRPOTrainer._compute_loss(self, None, inputs)
    return loss, {k: v[-1] for k, v in self._metrics["train"].items()}


def _grpo_tensors(seed=0, B=4, T=7, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    base = -torch.rand(B, T, generator=g) * 3
    old = base + 0.4 * torch.randn(B, T, generator=g)  # ratios far enough from 1 to clip on both sides
    ref = base + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[0] = 0.0  # a sequence with no trained token
    mask[1, 0] = 1.0
    return base, old, ref, adv, mask


CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=11),
    "dapo": dict(loss_type="dapo"),
    "dapo_num_items": dict(loss_type="dapo", num_items_in_batch=40),
    "asymmetric_clip": dict(loss_type="grpo", epsilon_low=0.1, epsilon_high=0.28),
    "kl_beta": dict(loss_type="bnpo", beta=0.04),
    "two_sided_delta": dict(loss_type="dapo", delta=1.3, epsilon_high=0.1),
    "is_correction": dict(loss_type="grpo", is_ratio=True, beta=0.1),
    "single_pass_old_none": dict(loss_type="dr_grpo", old_none=True),
    "per_token_advantages": dict(loss_type="grpo", per_token_adv=True, beta=0.02),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_loss_equals_trl(case):
    kw = dict(CASES[case])
    per_token_adv, old_none = kw.pop("per_token_adv", False), kw.pop("old_none", False)
    with_is = kw.pop("is_ratio", None)
    base, old, ref, adv, mask = _grpo_tensors(per_token_adv=per_token_adv)
    old = None if old_none else old
    ref = ref if kw.get("beta") else None
    is_w = None
    if with_is:
        noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(5))
        sampler = old + 0.5 * noise  # the rollout engine's logprobs differ from the trainer's
        is_w = importance_sampling_weights(old, sampler, mask, mode="token_truncate", clip_max=1.5)
        assert (is_w < 1.5).any() and (is_w == 1.5).any()  # the cap binds somewhere

    ours_in = base.clone().requires_grad_(True)
    ours, metrics = grpo_loss(ours_in, old, adv, mask, ref_logps=ref, is_weights=is_w, **kw)
    ours.backward()

    theirs_in = base.clone().requires_grad_(True)
    theirs, trl_metrics = trl_grpo_loss(theirs_in, old, adv, mask, ref_logps=ref, is_ratio=is_w, **kw)
    theirs.backward()

    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-6, atol=1e-7)
    assert ours_in.grad[mask == 0].abs().max() == 0  # untrained tokens get exactly no gradient
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert metrics[name].item() == pytest.approx(trl_metrics[name], abs=1e-6)
    if kw.get("beta"):
        assert metrics["kl"].item() == pytest.approx(trl_metrics["kl"], rel=1e-5)
    if old is not None and case in ("grpo", "asymmetric_clip"):
        # both sides of the clip are exercised
        assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0


def test_dapo_divisor_is_trls_rescaled_num_items():
    """TRL divides dapo by num_items_in_batch / num_processes * grad_accum / steps_per_generation."""
    base, old, _, adv, mask = _grpo_tensors(seed=3)
    theirs, _ = trl_grpo_loss(base, old, adv, mask, loss_type="dapo", num_items_in_batch=96, grad_accum=2,
                              steps_per_generation=4, num_processes=2)
    ours, _ = grpo_loss(base, old, adv, mask, loss_type="dapo", num_items_in_batch=96 / 2 * 2 / 4)
    torch.testing.assert_close(ours, theirs)


def test_grpo_accumulation_division_is_the_callers():
    """TRL divides grpo/bnpo/dr_grpo by the accumulation steps inside the loss; ours leaves it to the trainer."""
    base, old, _, adv, mask = _grpo_tensors(seed=4)
    theirs, _ = trl_grpo_loss(base, old, adv, mask, loss_type="bnpo", grad_accum=4)
    ours, _ = grpo_loss(base, old, adv, mask, loss_type="bnpo")
    torch.testing.assert_close(ours / 4, theirs)


def test_k3_kl_is_trls_formula_and_nonnegative():
    base, _, ref, _, mask = _grpo_tensors(seed=2)
    _, m = trl_grpo_loss(base, base, torch.zeros(base.size(0)), mask, ref_logps=ref, beta=1.0, loss_type="bnpo")
    kl = k3_kl(base, ref)
    assert (kl >= 0).all() and k3_kl(base, base).abs().max() == 0
    assert ((kl * mask).sum() / mask.sum()).item() == pytest.approx(m["kl"], rel=1e-6)


def test_grpo_loss_rejects_bad_input():
    base, old, _, adv, mask = _grpo_tensors()
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(base, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(base, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(base, old, torch.zeros(4, 3), mask)


# ------------------------------------------------------------------- IS weights: TRL's own code as the oracle


def _trl_block(method, start: str, stop: str) -> str:
    """The source lines of ``method`` from the line starting with ``start`` up to the one starting with ``stop``."""
    lines = inspect.getsource(method).splitlines()
    i = next(n for n, line in enumerate(lines) if line.strip().startswith(start))
    j = next(n for n in range(i + 1, len(lines)) if lines[n].strip().startswith(stop))
    return textwrap.dedent("\n".join(lines[i:j]))


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_sampling_weights_equal_trl(mode):
    block = _trl_block(GRPOTrainer._generate_and_score_completions,
                       "if self.use_vllm and self.vllm_importance_sampling_correction:",
                       "# Compute the per-token log probabilities for the reference model")
    base, old, _, _, mask = _grpo_tensors(seed=6)
    sampler = old + 0.6 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7))
    sampler_trl = sampler.clone()
    sampler_trl[2, 3] = float("nan")  # TRL: a token vLLM could not score; ours: logprob_mask 0
    sampler_mask = torch.ones_like(mask)
    sampler_mask[2, 3] = 0
    self = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                           vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    scope = {"self": self, "completion_mask": mask, "tool_mask": None, "old_per_token_logps": old,
             "sampling_per_token_logps": sampler_trl, "torch": torch, "math": math}
    exec(block, scope)
    ours = importance_sampling_weights(old, sampler, mask, mode=mode, clip_min=0.5, clip_max=2.0,
                                       sampler_mask=sampler_mask)
    torch.testing.assert_close(ours, scope["vllm_importance_sampling_ratio"])


# --------------------------------------------------------------------------------------------------- SFT


def trl_sft_loss(model, input_ids, labels, num_items_in_batch=None):
    """TRL's ``SFTTrainer.compute_loss`` (the default nll path through its fused LM head) on a minimal ``self``."""
    self = SimpleNamespace(model=model, aux_loss_enabled=False, compute_loss_func=None, label_smoother=None,
                           accelerator=SimpleNamespace(parallelism_config=None, gather_for_metrics=lambda x: x,
                                                       num_processes=1),
                           args=SimpleNamespace(loss_type="nll", average_tokens_across_devices=False),
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                           _tp_size=1, get_tp_size=lambda: 1)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    loss = SFTTrainer.compute_loss(self, model, inputs, num_items_in_batch=num_items_in_batch)
    return loss, {k: v[-1] for k, v in self._metrics["train"].items()}


@pytest.mark.parametrize("num_items_in_batch", [None, 37])
def test_sft_loss_equals_trl_with_completion_mask(num_items_in_batch):
    model = tiny_qwen2(seed=2).train()
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    mask[0, 4:] = 1
    mask[1, 2:6] = 1
    mask[2, 7:9] = 1
    mask[2, 0] = 1  # the first token has no prediction: ignored as HF's shift ignores it
    ours, metrics = sft_loss(model(input_ids=ids).logits, ids, mask, num_items_in_batch=num_items_in_batch)
    ours.backward()
    ours_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    labels = ids.masked_fill(mask == 0, -100)
    theirs, trl_metrics = trl_sft_loss(model, ids, labels, num_items_in_batch=num_items_in_batch)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    for a, b in zip(ours_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert metrics["num_tokens"].item() == 12
    assert metrics["mean_token_accuracy"].item() == pytest.approx(trl_metrics["mean_token_accuracy"])
    assert metrics["entropy"].item() == pytest.approx(trl_metrics["entropy"], rel=1e-5)


# ----------------------------------------------------------------------- multi-turn masks stop every gradient


def _two_turn_view():
    """system+user prompt, assistant turn 0 (tool call), tool result + template, assistant turn 1 (answer)."""
    t0 = Turn(message=AssistantMessage(content="call"), prompt_ids=[1, 10, 11, 12, 2], completion_ids=[20, 21, 22, 3],
              logprobs=[-0.5, -1.0, -0.7, -0.2])
    t1 = Turn(message=AssistantMessage(content="answer"), prompt_ids=[1, 10, 11, 12, 2, 20, 21, 22, 3, 4, 30, 31, 5, 2],
              completion_ids=[40, 41, 3], logprobs=[-0.9, -0.4, -0.1])
    (view,) = Trajectory(turns=[t0, t1]).token_view()
    assert view.turn_index == [-1] * 5 + [0] * 4 + [-1] * 5 + [1] * 3
    return view


@pytest.mark.parametrize("which", ["sft", "grpo"])
def test_multi_turn_mask_gives_no_gradient_to_context_tokens(which):
    view = _two_turn_view()
    ids = torch.tensor([view.input_ids])
    mask = torch.tensor([view.loss_mask])
    context = (mask[0] == 0).nonzero().flatten()
    context = context[context > 0]  # token 0 is never a target
    model = tiny_qwen2(seed=3)
    logits = model(input_ids=ids).logits.detach().requires_grad_(True)

    def loss_for(targets: torch.Tensor) -> torch.Tensor:
        if which == "sft":
            return sft_loss(logits, targets, mask)[0]
        logps = token_logprobs(logits, targets)
        old = torch.tensor([view.logprobs]) * torch.tensor([view.logprob_mask]) + logps.detach() * (
            1 - torch.tensor([view.logprob_mask]))
        return grpo_loss(logps, old, torch.tensor([1.5]), mask, ref_logps=logps.detach() - 0.2, beta=0.1,
                         loss_type="bnpo")[0]

    loss = loss_for(ids)
    loss.backward()
    grad = logits.grad[0]
    # logits at position t-1 predict token t: rows predicting a context (tool/user/template) token are exactly zero
    assert grad[context - 1].abs().max().item() == 0.0
    assert grad[(mask[0, 1:] == 1).nonzero().flatten()].abs().sum() > 0  # the trained rows do get gradient
    assert grad[-1].abs().max().item() == 0.0  # the last position predicts nothing
    # changing what the context tokens are, as targets, leaves the loss unchanged
    other = ids.clone()
    other[0, context] = (other[0, context] + 7) % 64
    with torch.no_grad():
        assert loss_for(other).item() == loss.item()
        changed = ids.clone()
        changed[0, 6] = (changed[0, 6] + 7) % 64  # a generated token: the loss must notice
        assert loss_for(changed).item() != loss.item()


def test_all_masked_batch_gives_exactly_zero_gradient_to_every_parameter():
    """A batch with no trained token (e.g. all tool/user text) is a finite zero loss with no parameter gradient."""
    view = _two_turn_view()
    ids = torch.tensor([view.input_ids])
    model = tiny_qwen2(seed=4)
    logits = model(input_ids=ids).logits
    zero = torch.zeros_like(ids)
    loss = sft_loss(logits, ids, zero)[0] + grpo_loss(token_logprobs(logits, ids), None, torch.tensor([1.0]), zero)[0]
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())
