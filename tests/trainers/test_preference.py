"""DPO and Constrained Preference Optimization (paper 6): TRL equality, the paper's properties, data, training.

TRL 1.16 is the oracle: ``DPOTrainer._compute_loss`` and ``_prepare_dataset`` run on a minimal
``self`` (the attributes they read), its fused LM head on a real model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from closedloop.messages import AssistantMessage, SystemMessage, Trajectory, UserMessage
from closedloop.trainers.config import ConfigError, load_config
from closedloop.trainers.preference_data import collate_pairs, encode_preference_rows, extract_prompt
from closedloop.trainers.preference_loss import (constrained_margin, constrained_preference_losses, dpo_losses,
                                                 sequence_logps)

trl = pytest.importorskip("trl")
from trl import DPOTrainer  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

torch.set_num_threads(1)
LOG2 = math.log(2)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


# ------------------------------------------------------------------------------------------ TRL oracle


class _Accel:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def trl_dpo_loss(token_logps, completion_mask, ref_chosen, ref_rejected, *, beta, loss_type):
    """TRL's ``DPOTrainer._compute_loss`` with precomputed reference log-probs; the model forward
    returns ``token_logps`` (``[2B, T-1]``, 0 where the label is -100, as its fused head does)."""
    n, t = completion_mask.shape
    out = SimpleNamespace(log_probs=token_logps, entropy=torch.zeros(n, t - 1), mean_logits=torch.zeros(n, t - 1),
                          is_top1=torch.zeros(n, t - 1, dtype=torch.bool))
    self = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_Accel(), aux_loss_enabled=False,
                           ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                           loss_types=[loss_type], loss_weights=[1.0], beta=beta, use_weighting=False,
                           _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(n, t, dtype=torch.long), "attention_mask": torch.ones(n, t, dtype=torch.long),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    return DPOTrainer._compute_loss(self, lambda **kw: out, inputs, False)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_dpo_loss_equals_trl_on_identical_tensors(loss_type, beta):
    g = torch.Generator().manual_seed(3)
    B, T = 4, 9
    mask = torch.zeros(2 * B, T, dtype=torch.long)
    for i, start in enumerate([2, 3, 5, 1, 4, 2, 6, 3]):  # different prompt and completion lengths
        mask[i, start:T - (i % 3)] = 1
    token_logps = -torch.rand(2 * B, T, generator=g) * 2
    token_logps[:, 0] = 0.0
    ref_token = token_logps + 0.5 * torch.randn(2 * B, T, generator=g)
    shifted = (token_logps * mask)[:, 1:]
    ref_sums, lengths = sequence_logps(ref_token, mask)
    theirs = trl_dpo_loss(shifted, mask, *ref_sums.chunk(2), beta=beta, loss_type=loss_type)

    sums, lengths = sequence_logps(token_logps, mask)
    ours = dpo_losses(*sums.chunk(2), *ref_sums.chunk(2), beta=beta, loss_type=loss_type,
                      chosen_lengths=lengths[:B], rejected_lengths=lengths[B:]).mean()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_sigmoid_length_normalize_equals_trl_sigmoid_norm():
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[:, :2] = 0
    mask[1, 5:] = 0
    token_logps = -torch.rand(4, 7, generator=g)
    token_logps[:, 0] = 0
    sums, lengths = sequence_logps(token_logps, mask)
    ref = sums + torch.tensor([0.3, -0.2, 0.1, 0.4])
    theirs = trl_dpo_loss((token_logps * mask)[:, 1:], mask, *ref.chunk(2), beta=0.5, loss_type="sigmoid_norm")
    ours = dpo_losses(*sums.chunk(2), *ref.chunk(2), beta=0.5, chosen_lengths=lengths[:2], rejected_lengths=lengths[2:],
                      length_normalize=True).mean()
    torch.testing.assert_close(ours, theirs)


def test_pair_logps_equal_trl_fused_lm_head_on_a_model(tiny_model_path, tokenizer):
    """The shift, the completion mask and the left-padded, last-columns-only LM head are right: the
    same summed log-probs as TRL's fused head on its right-padded batch."""
    from transformers import AutoModelForCausalLM

    from closedloop.trainers.dpo import pair_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "colour?"}],
             "chosen": [{"role": "assistant", "content": "blue"}],
             "rejected": [{"role": "assistant", "content": "a red one, I think"}]},
            {"prompt": "Hi there", "chosen": " friend", "rejected": " you"}]
    pairs = encode_preference_rows(rows, tokenizer)
    right = collate_pairs(pairs, tokenizer.pad_token_id)
    left = collate_pairs(pairs, tokenizer.pad_token_id, padding_side="left")
    assert left.position_ids is not None and bool((left.input_ids[:, -1] != tokenizer.pad_token_id).all())
    with torch.no_grad():
        ours_right, lengths = pair_logps(model, right)
        ours_left, lengths_left = pair_logps(model, left)
        trl_utils.add_fused_lm_head(model, outputs=("log_probs",))
        labels = right.input_ids.masked_fill(right.completion_mask == 0, -100)
        theirs = model(input_ids=right.input_ids, attention_mask=right.attention_mask, labels=labels,
                       fused_lm_head=True).log_probs.sum(1)
    torch.testing.assert_close(ours_right, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_left, theirs, rtol=1e-5, atol=1e-5)
    assert lengths.tolist() == lengths_left.tolist() == right.completion_mask[:, 1:].sum(1).float().tolist()


def test_tokenisation_equals_trl_prepare_dataset(tokenizer):
    from datasets import Dataset

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
             "chosen": [{"role": "assistant", "content": "5"}], "rejected": [{"role": "assistant", "content": "6"}]},
            {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
             "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}]}]
    self = SimpleNamespace(_tokenizer=tokenizer)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")  # what it reads
    for row, ours in zip(rows, encode_preference_rows(rows, tokenizer)):
        ds = DPOTrainer._prepare_dataset(self, Dataset.from_list([row]), tokenizer, args, "train")
        theirs = ds[0]
        assert (ours.prompt_ids, ours.chosen_ids, ours.rejected_ids) == (
            theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"])
    text = {"chosen": "The sky is blue", "rejected": "The sky is green"}
    assert extract_prompt(text) == trl.extract_prompt(text) | {}


# ------------------------------------------------------------------------------------ paper 6 properties


def test_cpo_branch_equals_dpo_as_gamma_goes_to_minus_infinity():
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (-torch.rand(16, generator=g) * 3 for _ in range(4))
    dpo = dpo_losses(c, r, rc, rr, beta=2.5, length_normalize=False)
    exact = constrained_preference_losses(c, r, rc, rr, variant="cpo", beta=2.5, gamma=-1e4, length_normalize=False)
    assert constrained_margin(rc, rr, variant="cpo", gamma=-1e4, tau=2.0).abs().max() == 0  # m is exactly 0
    torch.testing.assert_close(exact, dpo, rtol=1e-6, atol=1e-6)  # β·Δθ − β·Δref vs β(Δθ − Δref): rounding only
    gaps = [(constrained_preference_losses(c, r, rc, rr, variant="cpo", beta=2.5, gamma=gm, length_normalize=False)
             - dpo).abs().max().item() for gm in (0.0, -2.0, -5.0, -10.0)]
    assert gaps[0] > 0.05 and all(a > b for a, b in zip(gaps, gaps[1:])) and gaps[-1] < 1e-6


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.5])
def test_pathology_dpo_satisfied_while_policy_prefers_rejected_constrained_is_not(beta):
    """Δref = −2, Δθ = −1: DPO's logit is +β (loss < log 2) though the policy prefers y_l; the
    cpo logit β(1 − m) with m = softplus(2·2.5)/2 ≈ 2.50 is negative, and descent raises Δθ."""
    chosen = torch.tensor([-3.0], requires_grad=True)  # ℓθ(y_w); ℓθ(y_l) = −2 → Δθ = −1
    rejected = torch.tensor([-2.0], requires_grad=True)
    ref_c, ref_r = torch.tensor([-4.0]), torch.tensor([-2.0])  # Δref = −2
    dpo = dpo_losses(chosen, rejected, ref_c, ref_r, beta=beta, length_normalize=False)
    assert dpo.item() < LOG2
    torch.testing.assert_close(dpo, -torch.nn.functional.logsigmoid(torch.tensor([beta])))
    m = constrained_margin(ref_c, ref_r, variant="cpo", gamma=0.5, tau=2.0)
    torch.testing.assert_close(m, torch.tensor([math.log1p(math.exp(5.0)) / 2]))
    cpo = constrained_preference_losses(chosen, rejected, ref_c, ref_r, variant="cpo", beta=beta, gamma=0.5, tau=2.0,
                                        alpha=1.0, length_normalize=False)
    torch.testing.assert_close(cpo, -torch.nn.functional.logsigmoid(beta * (1 - m)))
    assert cpo.item() > LOG2
    cpo.sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()  # a descent step raises ℓ(y_w) and lowers ℓ(y_l)
    for variant in ("clip", "easy"):  # clip: target max(0, Δref) = 0, so Δθ = −1 is also penalised
        loss = constrained_preference_losses(chosen, rejected, ref_c, ref_r, variant=variant, beta=beta, gamma=0.5,
                                             length_normalize=False)
        if variant == "clip":
            assert loss.item() > LOG2
            torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(torch.tensor([-beta])))
        else:  # easy: m = γ(1/ℓref(y_w) + 1/ℓref(y_l)) = 0.5·(−1/4 − 1/2)
            torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(torch.tensor([beta + 0.375])))


def test_length_normalisation_and_bad_input():
    c, r = torch.tensor([-6.0]), torch.tensor([-2.0])
    lc, lr = torch.tensor([3.0]), torch.tensor([1.0])
    a = constrained_preference_losses(c, r, c, r, variant="clip", beta=1.0, chosen_lengths=lc, rejected_lengths=lr)
    b = constrained_preference_losses(c / lc, r / lr, c / lc, r / lr, variant="clip", beta=1.0,
                                      length_normalize=False)
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="lengths"):
        constrained_preference_losses(c, r, c, r)
    with pytest.raises(ValueError, match="variant"):
        constrained_preference_losses(c, r, c, r, variant="dpo", length_normalize=False)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_losses(c, r, c, r, loss_type="kto")


# ------------------------------------------------------------------------------------------------ data


def test_rows_from_jsonl_text_and_precomputed_reference(tokenizer, tmp_path):
    import json

    from closedloop.trainers.dpo import DPOConfig, build_pairs

    rows = [{"prompt": "Q: 2+3?", "chosen": " 5", "rejected": " 6", "ref_chosen_logps": -1.5,
             "ref_rejected_logps": -0.5}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(DPOConfig, None, [f"model={tmp_path}", f"output_dir={tmp_path}/o", f"dataset={path}"])
    (pair,) = build_pairs(cfg, tokenizer)
    assert pair.chosen_ids[-1] == tokenizer.eos_token_id and (pair.ref_chosen_logps, pair.ref_rejected_logps) == (
        -1.5, -0.5)
    batch = collate_pairs([pair], tokenizer.pad_token_id)
    assert batch.ref_logps.tolist() == [-1.5, -0.5]
    assert batch.completion_mask[0].sum() == len(pair.chosen_ids)
    with pytest.raises(ValueError, match="both ref_chosen_logps"):
        encode_preference_rows([{**rows[0], "ref_rejected_logps": None}], tokenizer)
    with pytest.raises(ValueError, match="row 0"):
        encode_preference_rows([{"prompt": "x", "chosen": "y"}], tokenizer)
    with pytest.raises(ConfigError, match="unknown store filter"):
        load_config(DPOConfig, None, [f"model={tmp_path}", "output_dir=o", "dataset=store:grph=react"])


def test_pairs_from_the_run_store_chosen_has_the_higher_reward(tokenizer, tmp_path):
    from closedloop.store import RunStore
    from closedloop.trainers.dpo import DPOConfig, build_pairs

    prompt = [SystemMessage(content="Add."), UserMessage(content="2+3?")]
    good = Trajectory(messages=[*prompt, AssistantMessage(content="5")], rewards={"success": 1.0},
                      metadata={"task_id": "t1"})
    bad = Trajectory(messages=[*prompt, AssistantMessage(content="6")], rewards={"success": 0.0},
                     metadata={"task_id": "t1"})
    lone = Trajectory(messages=[UserMessage(content="1+1?"), AssistantMessage(content="2")], rewards={"success": 1.0},
                      metadata={"task_id": "t2"})
    store = RunStore(tmp_path / "runs.duckdb")
    store.record_trajectories([bad, good, lone], kind="eval", graph="react")
    cfg = load_config(DPOConfig, None, [f"model={tmp_path}", f"output_dir={tmp_path}/o",
                                        f"store={tmp_path / 'runs.duckdb'}", "dataset=store:graph=react,status=null"])
    (pair,) = build_pairs(cfg, tokenizer)
    assert tokenizer.decode(pair.chosen_ids).startswith("5") and tokenizer.decode(pair.rejected_ids).startswith("6")
    cfg = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"graph": "other"})})
    with pytest.raises(ValueError, match="no pair"):
        build_pairs(cfg, tokenizer)


# --------------------------------------------------------------------------------------------- training


CANDIDATES = [("blue", "red"), ("yes", "no"), ("cat", "dog"), ("Hello!", "Thanks!")]


def _toy_rows(model, tokenizer):
    """One pair whose reference prefers the *rejected* answer, Δref nearest the paper's −2 (≤ −1.5)."""
    from closedloop.trainers.dpo import policy_margins

    best = None
    for a, b in CANDIDATES:
        row = {"prompt": [{"role": "user", "content": "colour?"}],
               "chosen": [{"role": "assistant", "content": a}], "rejected": [{"role": "assistant", "content": b}]}
        d = float(policy_margins(model, encode_preference_rows([row], tokenizer), tokenizer.pad_token_id,
                                 length_normalize=True)[0])
        if d > 0:
            row["chosen"], row["rejected"], d = row["rejected"], row["chosen"], -d
        if d <= -1.5 and (best is None or abs(d + 2) < abs(best[1] + 2)):
            best = (row, d)
    assert best is not None, f"no candidate pair with a strong enough reference preference: {best}"
    return [best[0]], best[1]


def test_toy_training_dpo_ends_preferring_rejected_constrained_does_not(tiny_model_path, tokenizer, tmp_path):
    """Paper 6 on a toy: the reference prefers y_l; DPO drives its loss near 0 with Δθ still < 0,
    the cpo variant ends with Δθ > 0. (Longer run: benchmarks/bench_preference_pathology.py.)"""
    from transformers import AutoModelForCausalLM

    from closedloop.trainers.cpref import ConstrainedPreferenceConfig, train_cpref
    from closedloop.trainers.dpo import DPOConfig, policy_margins, train_dpo

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    rows, d_ref = _toy_rows(base, tokenizer)
    pairs = encode_preference_rows(rows, tokenizer)
    common = [f"model={tiny_model_path}", "report_to=none", "max_steps=40", "per_device_batch_size=1",
              "torch_threads=1", "beta=5", "learning_rate=3e-5", "lr_scheduler=constant", "max_grad_norm=null",
              "length_normalize=true"]
    final = {}
    for name, cls, train in (("dpo", DPOConfig, train_dpo), ("cpref", ConstrainedPreferenceConfig, train_cpref)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        result = train(load_config(cls, None, common + [f"output_dir={tmp_path / name}"]), rows, model=model,
                       tokenizer=tokenizer)
        assert result.step == 40 and result.history[0]["delta_ref"] == pytest.approx(d_ref, abs=1e-4)
        final[name] = (float(policy_margins(model, pairs, tokenizer.pad_token_id, length_normalize=True)[0]),
                       result.history[-1]["loss"])
    (d_dpo, loss_dpo), (d_cpo, _) = final["dpo"], final["cpref"]
    assert loss_dpo < 0.05 * LOG2 and d_dpo < 0  # DPO is "done" while the policy still prefers y_l
    assert d_cpo > 0


def test_cli_knows_dpo_and_cpref(tmp_path, capsys):
    from closedloop.cli import main

    assert main(["train", "cpref", "--list-keys"]) == 0
    keys = capsys.readouterr().out
    assert "variant ('cpo')" in keys and "gamma (0.5)" in keys and "tau (2.0)" in keys
    assert main(["train", "dpo", "--set", f"model={tmp_path}", "--set", "output_dir=o", "--set",
                 "dataset=store:graph=react,strategy=best_worst", "--print-config"]) == 0
    assert "strategy: best_worst" in capsys.readouterr().out
    assert main(["train", "dpo", "--set", f"model={tmp_path}", "--set", "output_dir=o", "--set",
                 "loss_type=kto", "--print-config"]) == 2


@pytest.mark.parametrize("setup", [["lora.r=4", "precompute_ref_log_probs=true"], ["lora.r=4"],
                                   ["precompute_ref_log_probs=true"], ["loss_type=ipo"]])
def test_reference_is_the_starting_policy_in_every_setup(tiny_model_path, tokenizer, tmp_path, setup):
    """Step 1 sees policy = reference (copy, adapters off, precomputed): sigmoid loss log 2, IPO 1/(2β)²;
    then the policy moves and the loss falls."""
    from closedloop.trainers.dpo import DPOConfig, train_dpo

    rows = [{"prompt": [{"role": "user", "content": f"{a} plus {b}?"}],
             "chosen": [{"role": "assistant", "content": f"{a + b}"}],
             "rejected": [{"role": "assistant", "content": f"{a + b + 1}"}]} for a, b in ((1, 2), (3, 4), (5, 6))]
    cfg = load_config(DPOConfig, None, [f"model={tiny_model_path}", f"output_dir={tmp_path}", "report_to=none",
                                        "max_steps=3", "per_device_batch_size=3", "learning_rate=1e-2",
                                        "torch_threads=1", "beta=0.5", *setup])
    history = train_dpo(cfg, rows).history
    first = 1.0 if cfg.loss_type == "ipo" else LOG2  # (0 − 1/(2·0.5))² = 1
    assert history[0]["loss"] == pytest.approx(first, abs=1e-5)
    assert history[0]["delta_theta"] == pytest.approx(history[0]["delta_ref"], abs=1e-5)
    assert history[-1]["loss"] < first


def test_cli_trains_cpref_from_jsonl_and_records_the_run(tiny_model_path, tmp_path, capsys):
    import json

    from closedloop.cli import main
    from closedloop.store import RunStore

    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "colour?"}],
                                "chosen": [{"role": "assistant", "content": "blue"}],
                                "rejected": [{"role": "assistant", "content": "red"}]}) + "\n")
    store = tmp_path / "runs.duckdb"
    assert main(["train", "cpref", "--set", f"model=hf:{tiny_model_path}", "--set", f"output_dir={tmp_path / 'out'}",
                 "--set", f"dataset={data}", "--set", "max_steps=2", "--set", f"store={store}", "--set",
                 "logging_steps=1", "--set", "torch_threads=1", "--set", "variant=clip"]) == 0
    assert "done: 2 steps" in capsys.readouterr().out
    (run,) = RunStore(store).list_runs(kind="train")
    assert run.status == "completed"
    logged = RunStore(store).metrics(run.id)
    assert len(logged) == 2 and {"loss", "delta_theta", "policy_accuracy"} <= set(logged[-1])
    assert (tmp_path / "out" / "config.json").is_file()
