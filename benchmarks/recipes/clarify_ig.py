"""The information-gain clarifier experiment on the built-in ``clarify`` environment.

From one SFT start (the model imitating the scripted expert), two GRPO runs with identical seeds
and settings except the reward:

- ``success``: success − cost per turn (the information-gain component weighs 0);
- ``ig``: the same plus the exact per-turn information gain (nats) as a per-turn reward
  (turn-level advantages, ``turn_reward_components=[info_gain]``), credited to the turn that
  asked: ``--gamma 0`` (default) makes a turn's return-to-go its own gain. With γ = 1 the
  return-to-go of *any* question, an uninformative one included, is the gain of the rest of the
  episode, so the per-turn reward cannot single out the question that told nothing. Questions are
  compared only with questions (``--missing-turn-rewards exclude``, default): a turn that asks
  nothing (the submit) has no information gain at all, not a gain of 0 (``clarify`` names
  ``info_gain`` in ``info["inapplicable_rewards"]`` on such a step), so it gets no turn advantage
  and stays out of the baseline, which pools the group's questions (``--turn-baseline group``,
  default). With ``zero`` (the trainer's default) the submit counts as a gain of 0 and is compared
  with questions: pooled (``group``), it is pushed down in every episode and the IG policy
  unlearns submitting; per turn index (``position``), a submit after two good questions is pushed
  down whenever another episode of the group asks its first new question at that index after a
  repeat, which rewards asking as such (both measured below, "before").

All three policies are then evaluated on the same held-out seeds, greedily and sampled at T = 1
(``--eval-temperatures``): success (Wilson 95% CI), mean questions, mean uninformative questions
(questions whose answer did not shrink the candidate set: exact IG = 0). Both, because a greedy
policy shows only its most likely question: the SFT policy below asks 0.9 uninformative questions
per episode sampled and none greedily, and GRPO trains the sampled policy. The paper's claim, in
sign: the IG-trained policy asks fewer uninformative questions at equal or better success.

Tasks (``--task``):

- ``level``: ``clarify`` at ``--level`` with its built-in vocabulary and ids ``c1..cN``;
- ``tiny`` (default): a task the 150k-parameter tiny model can learn (:data:`TINY_TASK`): 4 items
  over 2 fixed attributes (size, shelf) with 2 values each, the values digits (the tokenizer splits
  numbers into digits and the tiny model's warm-up taught it to copy them into tool arguments),
  items named by their values (``7 3``) so a submit copies the answers, and an imperfect expert
  (``expert_noise=0.3``: ~0.15 uninformative questions per demonstration) so that SFT starts with
  uninformative questions to remove. Why: with the ``level`` task, SFT'd tiny models neither spell
  the attribute names nor look an id up in the catalogue (greedy success ≈ 1/N), so asking cannot
  pay and success-only GRPO learns to guess; with word values (``Oslo snowy``) they ask correctly
  but never copy a multi-token answer (greedy success 0.05 after 500 SFT steps); with digits,
  greedy success after SFT is 1.0 and the sampled (T = 1) policy still asks ~0.9 uninformative
  questions per episode.

The pipeline is the recipe ``clarify_ig.yaml`` beside this module (which holds the task and the
evaluation stage). ``--set env_options=JSON`` overrides any environment option of the chosen task;
``--set sft_model=DIR`` reuses an SFT checkpoint (a second GRPO seed from the same start; running
the recipe again into the same ``out`` with another ``seed`` skips the SFT stage by itself);
``--set eval_steps=10`` also evaluates (sampled) each arm's checkpoint after 10 GRPO steps;
``--set no_eval_sft=true`` skips the SFT row; ``--set turn_weight=w`` scales the IG arm's turn
advantage (A = A^final + w·A^turn, ``GRPOConfig.turn_weight``).

    closedloop recipe run benchmarks/recipes/clarify_ig.yaml --set model=PATH_TO_TINY --set out=out/clarify-ig  # ~20 min
    closedloop recipe run benchmarks/recipes/clarify_ig.yaml --quick                                          # a smoke run

The commands in "Measured" below predate the recipe (``python benchmarks/bench_clarify_ig.py
--grpo-steps 25 --seed 1 ...``): every flag is now a param of the same name, dashes as
underscores (``closedloop recipe run benchmarks/recipes/clarify_ig.yaml --set grpo_steps=25 --set seed=1``;
a bare flag such as ``--no-eval-sft`` is ``--set no_eval_sft=true``).

Measured
--------
2 shared CPU cores (busy with other work), the shared prebuilt tiny model ($TINY, 150k parameters),
task ``tiny``, SFT 4000 expert episodes × 500 steps (470 s), GRPO 25 steps × 64 episodes per arm
(3-4 min each), 200 held-out seeds, evaluated greedily and sampled (T = 1).

**Turn weight 0.25** (``--turn-weight 0.25``: the IG arm's advantage is A^final + 0.25·A^turn, so the
A^turn ≈ −3.9 of a rare uninformative question, below, weighs about −1, the size of a final advantage),
questions compared only with questions in the group's pool (``group`` + ``exclude``, as "IG" below).
A fresh SFT start with the same settings (``out/clarify-ig3/sft``, 337 s; its rows equal the earlier
start's: sampled 0.405 / 2.55 / 0.895, greedy 1.000 / 2.00 / 0.000); both arms of a seed in one process.
The success arm is rerun in each process and is not token-identical with the success arm of the
series below (same seed and SFT row, other numbers: e.g. 0.670 vs 0.690 with turn cost, seed 0, 25
steps), so compare the arms within this section. Commands (``S="--sft-model out/clarify-ig3/sft
--grpo-steps 25 --eval-steps 10 --no-eval-sft --turn-weight 0.25"``)::

    python $B --model $TINY --out out/clarify-ig3 --grpo-steps 25 --eval-steps 10 --turn-weight 0.25 \
        --seed 0                                                          # SFT + seed 0 with turn cost, 793 s
    for seed in 1 2 3 4; do python $B $S --out out/clarify-ig3/cost --seed $seed; done       # 379-420 s each
    for seed in 0 1 2 3 4; do
      python $B $S --out out/clarify-ig3/nocost --env-options '{"turn_cost": 0}' --seed $seed  # 389-436 s each
    done

(GRPO 150-182 s per arm; seeds 3 and 4 were added after 0-2 because time allowed, so the means over
seeds 0-2 are given too.) Sampled (T = 1), each cell success / questions / uninformative questions per
episode over 200 held-out episodes (Wilson 95% CI about ± 0.07); rows are (turn cost, turns): seed:

=================  ================  ================  ================  ================
cost, turns: seed  success @ 10      IG @ 10           success @ 25      IG @ 25
=================  ================  ================  ================  ================
0.05, 4: 0         0.475 1.84 0.085  0.535 1.93 0.125  0.670 1.95 0.060  0.610 1.92 0.055
0.05, 4: 1         0.520 1.98 0.170  0.560 1.88 0.070  0.670 1.94 0.035  0.665 1.90 0.035
0.05, 4: 2         0.640 1.93 0.075  0.505 1.92 0.080  0.660 1.93 0.070  0.695 1.91 0.030
0.05, 4: 3         0.555 1.95 0.115  0.525 1.94 0.095  0.580 1.86 0.030  0.635 1.84 0.015
0.05, 4: 4         0.605 1.94 0.105  0.590 1.92 0.080  0.645 1.99 0.105  0.665 1.88 0.050
0.05, 4: mean 0-2  0.545 1.91 0.110  0.533 1.91 0.092  0.667 1.93 0.055  0.657 1.91 0.040
0.05, 4: mean 0-4  0.559 1.93 0.110  0.543 1.92 0.090  0.645 1.93 0.060  0.654 1.89 0.037
0, 4: 0            0.540 1.91 0.085  0.570 1.89 0.060  0.620 1.94 0.085  0.660 1.91 0.040
0, 4: 1            0.530 1.95 0.135  0.495 1.99 0.125  0.660 1.96 0.105  0.670 1.92 0.025
0, 4: 2            0.625 1.95 0.075  0.540 1.91 0.050  0.605 2.06 0.195  0.660 1.84 0.030
0, 4: 3            0.495 1.91 0.085  0.545 1.93 0.095  0.595 1.90 0.040  0.610 1.89 0.020
0, 4: 4            0.595 1.93 0.100  0.530 1.93 0.125  0.635 1.92 0.060  0.520 1.90 0.065
0, 4: mean 0-2     0.565 1.94 0.098  0.535 1.93 0.078  0.628 1.99 0.128  0.663 1.89 0.032
0, 4: mean 0-4     0.557 1.93 0.096  0.536 1.93 0.091  0.623 1.95 0.097  0.624 1.89 0.036
=================  ================  ================  ================  ================

IG (turn weight 0.25) − success only, as below (success pooled over the seeds, normal approximation,
which ignores the variance between training seeds; per-seed differences in uninformative questions,
then in success)::

    (0.05, 4) @ 10, seeds 0-4: success -0.016 [-0.060, +0.028]; uninformative +0.040, -0.100, +0.005, -0.020, -0.025
    (0.05, 4) @ 25, seeds 0-4: success +0.009 [-0.033, +0.051]; uninformative -0.005, +0.000, -0.040, -0.015, -0.055
                                per-seed success -0.060, -0.005, +0.035, +0.055, +0.020
    (0.05, 4) @ 25, seeds 0-2: success -0.010 [-0.064, +0.044]
    (0, 4) @ 10, seeds 0-4:    success -0.021 [-0.065, +0.023]; uninformative -0.025, -0.010, -0.025, +0.010, +0.025
    (0, 4) @ 25, seeds 0-4:    success +0.001 [-0.041, +0.043]; uninformative -0.045, -0.080, -0.165, -0.020, +0.005
                                per-seed success +0.040, +0.010, +0.055, +0.015, -0.115
    (0, 4) @ 25, seeds 0-2:    success +0.035 [-0.019, +0.089]

Greedy, success / uninformative per seed (0-4)::

    (0.05, 4) success 0.975/0.000, 1.000/0.000, 1.000/0.000, 0.995/0.000, 1.000/0.000
              IG      0.945/0.000, 1.000/0.000, 1.000/0.000, 0.970/0.000, 0.995/0.000
    (0, 4)    success 0.995/0.000, 0.995/0.000, 0.990/0.005, 0.990/0.005, 0.980/0.000
              IG      0.950/0.000, 0.980/0.000, 0.980/0.000, 0.985/0.000, 0.890/0.005

Reading: with turn weight 0.25 the sign holds at 25 steps in both settings, sampled, but the
reduction is small. The IG arm loses no success (pooled +0.009 [−0.033, +0.051] with turn cost,
+0.001 [−0.041, +0.043] without; with turn weight 1, below: −0.082 [−0.136, −0.027] and −0.025
[−0.080, +0.030]) and asks fewer uninformative questions than success only in 8 of 10 pairs (one
tie, seed 1 with turn cost, 0.035 each; one more, seed 4 without, +0.005): means 0.037 vs 0.060 with
turn cost, 0.036 vs 0.097 without. So "fewer uninformative questions at equal or better success"
(the pooled success CI contains 0, its point estimate ≥ 0 over 5 seeds; over seeds 0-2 −0.010
[−0.064, +0.044] with turn cost, +0.035 [−0.019, +0.089] without) holds in both settings, for the
first time with a turn cost. What qualifies it:

- The differences are small with turn cost (0 to −0.055 per episode), because success only, rerun
  here, already keeps few (0.060 at 25 steps; 0.118 in the series below); without turn cost they
  are larger (−0.020 to −0.165, one +0.005). The IG arm's own level over seeds 0-2 (0.040 with turn
  cost, 0.032 without) is close to turn weight 1's below (0.032, 0.030; other processes).
- At 10 steps there is no sign: fewer in 6 of 10 pairs, success −0.016 [−0.060, +0.028] and −0.021
  [−0.065, +0.023]. With turn weight 1 the IG arm had fewer in every pair at 10 steps (at a success
  cost); with a quarter of the turn term the reduction shows only by 25 steps.
- Per seed the success difference still spans −0.115 to +0.055 and the pooled CI ignores that
  spread. Seed 4 without turn cost is the one IG run that falls behind (0.520 vs 0.635 sampled, 0.890
  greedy, 34.1 of 64 training rollouts truncated per step over steps 1-10 against 29.0-32.7 for the
  other IG runs and 29.7-32.6 for success only), and by the weight-1 failure: episodes whose answers
  had identified the goal and that never made a valid submit, 72 vs 52 of 200 (seed 0 without turn
  cost: 47 vs 50; the failure sort of ``clarify_ig_failures.py``, run on these policies by hand since
  that script names the weight-1 directories).
- Greedy, no policy asks an uninformative question (≤ 0.005 per episode) and the IG arm's success is
  lower than success only's in 8 of 10 pairs (equal in 2; means 0.982 vs 0.994 with turn cost, 0.957
  vs 0.990 without): the greedy policy shows the IG term's small cost, not its benefit.

Turn weight 0.1 was not run (planned only if 0.25 still lost success).

**Questions compared only with questions** (``--missing-turn-rewards exclude``), from the same SFT
start (``out/clarify-ig/sft``, below), both arms of a seed in one process (the shared model and
rollout code changed between processes of this series; the lead reports those changes
token-identical, but only the two arms of one invocation are guaranteed the same code). Commands
(``B=benchmarks/bench_clarify_ig.py``, ``S="--sft-model out/clarify-ig/sft --grpo-steps 25
--eval-steps 10 --no-eval-sft"``)::

    for seed in 0 1 2; do
      python $B $S --out out/clarify-ig2/cost --seed $seed                                  # 474-527 s each
      python $B $S --out out/clarify-ig2/nocost --env-options '{"turn_cost": 0}' --seed $seed   # 439-522 s
    done
    python $B $S --out out/clarify-ig2/nocost6 --env-options '{"turn_cost": 0, "max_turns": 6}' --seed 0  # 1057 s
    for seed in 0 1 2; do  # IG arm only, baseline per turn index
      python $B $S --arms ig --turn-baseline position --out out/clarify-ig2/cost --seed $seed
      python $B $S --arms ig --turn-baseline position --out out/clarify-ig2/nocost \
          --env-options '{"turn_cost": 0}' --seed $seed
    done

Sampled (T = 1), each cell success / questions / uninformative questions per episode (a cell's
Wilson 95% CI on success is about ± 0.07 at 200 episodes); "IG" pools the group's questions
(``--turn-baseline group``), "IG pos" compares each question with the group's questions at the
same turn index (``position``); "@ 10" is the run's checkpoint after 10 GRPO steps:

==============================  =================  =================  =================  =================
arm @ GRPO step (cost, turns)   seed 0             seed 1             seed 2             mean
==============================  =================  =================  =================  =================
success @ 10 (0.05, 4)          0.480 1.89 0.095   0.540 1.93 0.130   0.620 1.92 0.060   0.547 1.91 0.095
IG @ 10 (0.05, 4)               0.420 1.79 0.050   0.475 1.89 0.085   0.440 1.90 0.050   0.445 1.86 0.062
IG pos @ 10 (0.05, 4)           0.495 1.97 0.105   0.520 2.11 0.245   0.565 1.92 0.055   0.527 2.00 0.135
success @ 25 (0.05, 4)          0.690 1.92 0.030   0.680 1.99 0.130   0.610 2.06 0.195   0.660 1.99 0.118
IG @ 25 (0.05, 4)               0.615 1.85 0.020   0.620 1.92 0.020   0.500 1.92 0.055   0.578 1.90 0.032
IG pos @ 25 (0.05, 4)           0.665 1.98 0.075   0.620 1.95 0.090   0.635 1.89 0.030   0.640 1.94 0.065
success @ 10 (0, 4)             0.580 2.02 0.185   0.530 1.95 0.150   0.625 1.94 0.070   0.578 1.97 0.135
IG @ 10 (0, 4)                  0.430 1.84 0.060   0.545 1.95 0.095   0.400 1.89 0.035   0.458 1.89 0.063
IG pos @ 10 (0, 4)              0.550 2.06 0.215   0.540 2.02 0.165   0.350 1.95 0.090   0.480 2.01 0.157
success @ 25 (0, 4)             0.660 1.97 0.135   0.645 1.94 0.070   0.625 1.84 0.055   0.643 1.92 0.087
IG @ 25 (0, 4)                  0.630 1.83 0.025   0.645 1.88 0.030   0.580 1.89 0.035   0.618 1.87 0.030
IG pos @ 25 (0, 4)              0.615 2.06 0.215   0.680 1.93 0.020   0.500 1.90 0.050   0.598 1.96 0.095
success @ 10 (0, 6)             0.350 2.03 0.280   -                  -                  0.350 2.03 0.280
IG @ 10 (0, 6)                  0.245 1.46 0.035   -                  -                  0.245 1.46 0.035
success @ 25 (0, 6)             0.615 2.27 0.395   -                  -                  0.615 2.27 0.395
IG @ 25 (0, 6)                  0.525 1.76 0.045   -                  -                  0.525 1.76 0.045
==============================  =================  =================  =================  =================

IG − success only, success pooled over the seeds (normal approximation over 200 × seeds episodes
per arm; it ignores the variance between training seeds, so it understates the uncertainty),
and the per-seed difference in uninformative questions per episode::

    ig (0.05, 4) @ 10: success -0.102 [-0.158, -0.045]; uninformative per seed -0.045, -0.045, -0.010
    ig (0.05, 4) @ 25: success -0.082 [-0.136, -0.027]; uninformative per seed -0.010, -0.110, -0.140
    igpos (0.05, 4) @ 10: success -0.020 [-0.076, +0.036]; uninformative per seed +0.010, +0.115, -0.005
    igpos (0.05, 4) @ 25: success -0.020 [-0.074, +0.034]; uninformative per seed +0.045, -0.040, -0.165
    ig (0, 4) @ 10: success -0.120 [-0.176, -0.064]; uninformative per seed -0.125, -0.055, -0.035
    ig (0, 4) @ 25: success -0.025 [-0.080, +0.030]; uninformative per seed -0.110, -0.040, -0.020
    igpos (0, 4) @ 10: success -0.098 [-0.155, -0.042]; uninformative per seed +0.030, +0.015, +0.020
    igpos (0, 4) @ 25: success -0.045 [-0.100, +0.010]; uninformative per seed +0.080, -0.050, -0.005
    ig (0, 6) @ 10: success -0.105 [-0.194, -0.016]; uninformative per seed -0.245
    ig (0, 6) @ 25: success -0.090 [-0.187, +0.007]; uninformative per seed -0.350

Greedy, success / uninformative per seed::

    (0.05, 4) success 0.950/0.000, 1.000/0.000, 0.940/0.050; IG 0.970/0.000, 0.965/0.005, 0.930/0.000;
              IG pos 0.955/0.000, 0.980/0.005, 0.980/0.000
    (0, 4)    success 1.000/0.000, 1.000/0.000, 0.985/0.005; IG 0.965/0.000, 1.000/0.000, 1.000/0.000;
              IG pos 0.965/0.035, 1.000/0.000, 1.000/0.000
    (0, 6)    success 1.000/0.000; IG 0.875/0.000

Reading: the paper's sign is shown only in part. Comparing questions only with questions, the
pooled IG arm asks fewer uninformative questions than success only in every seed and setting, but
at equal success (within CIs, pooled over seeds) only without a turn cost in 4 turns; elsewhere its
success is lower. The per-index arm keeps success but does not reduce them consistently.

- Pooled over the group's questions ("IG", ``group`` + ``exclude``): fewer uninformative questions
  than success only in every pair (3 seeds × 2 settings × 2 checkpoints, plus the 6-turn seed at
  both: 14 of 14; means at 25 steps 0.032 vs 0.118 with turn cost, 0.030 vs 0.087 without, 0.045 vs 0.395
  with 6 turns), and sooner (at 10 steps 0.062 vs 0.095 and 0.063 vs 0.135), but at a cost in
  success: lower in 6 of 7 pairs at 25 steps (equal in 1; every pair's CIs overlap), pooled
  −0.082 [−0.136, −0.027] with turn cost, −0.025 [−0.080, +0.030] without, −0.090 [−0.187, +0.007]
  with 6 turns, and −0.10 to −0.12 (CIs exclude 0) at 10 steps. The sign ("fewer uninformative
  questions at equal or better success") holds in one setting: no turn cost, 4 turns, 25 steps.
  Where the success goes (turn cost, final policies, ``benchmarks/clarify_ig_failures.py
  out/clarify-ig2/cost``, which reproduces the table's success exactly): not to guessing (no
  episode of either arm submits a wrong guess) but to submitting: episodes whose answers had
  identified the goal and that then never made a valid submit within the 4 turns, IG vs success
  only, 52 vs 47, 58 vs 42, 72 vs 56 of 200 (seeds 0-2); not identified 21 vs 14, 14 vs 17, 19 vs
  17. The IG policy also asks fewer questions in all (means 1.87-1.90 vs 1.92-1.99 in 4 turns;
  1.76 vs 2.27 in 6 turns, 1.46 at 10 steps; 2 are needed) and in 4 turns truncates more rollouts
  while training (34-40 vs 30-32 of 64 per step, mean of steps 1-10; the per-index arm 32-38).
  Why (an analysis, not measured): the turn term is large and concentrated (σ is small when
  uninformative questions are rare: one zero among 17 questions gets A^turn ≈ −3.9) on turns whose
  tool-call tokens a submit shares except the name and argument; and the pooled baseline mixes
  turn indices (a first question always gains ln 2, later ones less on average), so it also says
  *whether* to ask at a turn, not only *which* question.
- Per turn index ("IG pos", ``position`` + ``exclude``), which removes that mixing: success at 25
  steps within the CIs of success only (pooled −0.020 [−0.074, +0.034] with turn cost, −0.045
  [−0.100, +0.010] without; at 10 steps without turn cost −0.098 [−0.155, −0.042]), but fewer
  uninformative questions in only 4 of 6 pairs at 25 steps (two of them by 0.005 and 0.040; means
  0.065 vs 0.118 with turn cost, 0.095 vs 0.087 without) and in 1 of 6 at 10 steps: no consistent
  sign.
- The exclusion itself does what it is for: with ``zero`` and the pooled baseline the IG policy
  stopped submitting ("before": 0.500 success, truncation 22-49 of 64); with ``exclude`` both
  baselines keep submitting, and greedy success stays 0.93-1.00 (0.875 for the 6-turn IG arm).

So on this task the per-turn information gain does remove uninformative questions that success-only
GRPO leaves (most clearly without a turn cost, where success only has the weakest pressure against
them), but with the pooled baseline it trades success for it, and with the per-index baseline the
reduction is not consistent across seeds. Not tuned: ``--ig-weight`` (irrelevant under
σ-scaling), ``turn_weight`` 1, ``scale_rewards`` group, lr 5e-4 are as before; every finished run
is in the table (the 6-turn setting has one seed: its seed-1 run was stopped during training to
make room for the per-index arm, seed 2 never started).

**Before: the submit compared with questions** (``--missing-turn-rewards zero``, the trainer's
default; previous session, its code), SFT included; success [Wilson 95% CI] / questions /
uninformative questions per episode. Commands (``S="--sft-model out/clarify-ig/sft --grpo-steps 25
--turn-baseline position --missing-turn-rewards zero"``; the option did not exist then, zero was
the only rule)::

    python $B --model $TINY --out out/clarify-ig --grpo-steps 25 --seed 0 \
        --turn-baseline group --missing-turn-rewards zero                                # SFT + rows 2-3, 1172 s
    python $B $S --out out/clarify-ig --arms ig --seed 0                                  # row 4, 289 s
    python $B $S --out out/clarify-ig --seed 1                                            # rows 9-10, 438 s
    python $B $S --out out/clarify-ig-nocost --env-options '{"turn_cost": 0}' --seed 0    # rows 5-6, 513 s
    python $B $S --out out/clarify-ig-nocost --env-options '{"turn_cost": 0}' --seed 1    # rows 7-8, 468 s
    python $B $S --out out/clarify-ig-nocost6 --env-options '{"turn_cost": 0, "max_turns": 6}' --seed 0  # 721 s

Greedy, every policy: success 0.97-1.00, 2.00-2.02 questions, 0-0.015 uninformative, except
the IG arm without turn cost, seed 0 (0.935 [0.89, 0.96]). Sampled (T = 1):

==========================================  =====================  ====  =====
policy (turn cost, IG baseline, GRPO seed)  success                q     uninf
==========================================  =====================  ====  =====
SFT                                         0.405 [0.339, 0.474]   2.55  0.895
success only (0.05, -, 0)                   0.640 [0.571, 0.703]   1.88  0.030
IG 0.5/nat (0.05, group, 0)                 0.500 [0.431, 0.569]   2.24  0.355
IG 0.5/nat (0.05, position, 0)              0.625 [0.556, 0.689]   1.97  0.070
success only (0, -, 0)                      0.660 [0.592, 0.722]   2.08  0.170
IG 0.5/nat (0, position, 0)                 0.605 [0.536, 0.670]   1.94  0.115
success only (0, -, 1)                      0.620 [0.551, 0.684]   1.93  0.055
IG 0.5/nat (0, position, 1)                 0.645 [0.577, 0.708]   2.00  0.130
success only (0.05, -, 1)                   0.650 [0.582, 0.713]   1.97  0.105
IG 0.5/nat (0.05, position, 1)              0.635 [0.566, 0.699]   1.95  0.070
SFT, max_turns 6                            0.415 [0.349, 0.484]   3.11  1.445
success only (0, -, 0), max_turns 6         0.625 [0.556, 0.689]   2.13  0.255
IG 0.5/nat (0, position, 0), max_turns 6    0.630 [0.561, 0.694]   2.37  0.455
==========================================  =====================  ====  =====

Reading then: the paper's sign is NOT shown. SFT leaves the sampled policy with 0.9 uninformative
questions per episode; both GRPO arms (position baseline) remove most of them at the same budget
and reach the same success (every pair of CIs overlaps), and which arm keeps fewer flips with the
seed (IG vs success only: 0.070 vs 0.030 and 0.070 vs 0.105 with turn cost; 0.115 vs 0.170 and
0.130 vs 0.055 without; 2-seed means 0.070 vs 0.068 and 0.123 vs 0.113). Success-only GRPO has
its own pressure against them: two uninformative questions exhaust the 4-turn budget, and each
costs a turn when turn_cost > 0; without either pressure (no turn cost, 6 turns) the IG arm kept
more of them than success only (0.455 vs 0.255, one seed). Greedy policies ask (almost) no
uninformative question, from SFT on. With the trainer's pooled turn baseline (``group``) the IG
policy stops submitting (22-49 of 64 rollouts truncated per step) and loses success (0.500 vs
0.640, CIs apart); ``position`` fixes that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from closedloop.trainers.recipes import StageContext, StageKind

#: The ``tiny`` task's environment options (see the module docstring).
TINY_TASK: dict[str, Any] = {
    "n_candidates": 4, "n_attributes": 2, "n_values": 2, "item_ids": "values", "expert_noise": 0.3,
    "attribute_values": {"size": list("123456789"), "shelf": list("123456789")},
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Task(_Strict):
    """The environment options of every stage (expert data, GRPO, evaluation)."""

    task: str
    level: int
    env_options: str | dict[str, Any] | None = None
    expert_noise: float | None = None
    arms: list[str]


def _task(config: Task, ctx: StageContext) -> dict[str, Any]:
    from closedloop.evals.envs import make_env

    if config.task not in ("tiny", "level"):
        raise ValueError(f"task: tiny or level, got {config.task!r}")
    if not config.arms or set(config.arms) - {"success", "ig"}:
        raise ValueError(f"arms: success and/or ig, got {config.arms}")
    opts: dict[str, Any] = dict(TINY_TASK) if config.task == "tiny" else {"level": config.level}
    extra = json.loads(config.env_options) if isinstance(config.env_options, str) else config.env_options
    opts.update(extra or {})
    if config.expert_noise is not None:
        opts["expert_noise"] = config.expert_noise
    env = make_env("clarify", **opts)  # bad options fail here, before any training
    return {"env_options": opts, "max_turns": env._max_turns()}


TASK = StageKind(Task, _task, "the clarify task's options and turn budget")


class Evaluate(_Strict):
    """Each policy on the same held-out seeds, greedy and sampled; the table and the results file."""

    sft: str | None  # the SFT model (null: no SFT row)
    arms: list[str]  # success and/or ig: the stages grpo-<arm>
    eval_steps: list[int]  # also the arms' checkpoints after these steps, sampled only
    grpo_steps: int
    env_options: dict[str, Any]
    max_turns: int
    episodes: int
    temperatures: list[float]
    seed: int
    title: str
    results: str
    extra: dict[str, Any] = {}


def _policies(config: Evaluate, ctx: StageContext) -> list[tuple[str, str, list[float]]]:
    temps, sampled = config.temperatures, [t for t in config.temperatures if t > 0]
    policies = [] if config.sft is None else [("sft", config.sft, temps)]
    for arm in config.arms:
        grpo = ctx.outputs[f"grpo-{arm}"]
        for step in config.eval_steps:
            if step < config.grpo_steps:
                ckpt = Path(grpo["model_dir"]) / f"checkpoint-{step}"
                if not ckpt.is_dir():
                    raise ValueError(f"eval_steps {step}: no {ckpt} (steps must be multiples of the smallest)")
                policies.append((f"grpo-{arm}@{step}", str(ckpt), sampled))
        policies.append((f"grpo-{arm}", grpo["model_dir"], temps))
    return policies


def _evaluate(config: Evaluate, ctx: StageContext) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from closedloop.trainers.recipes.stages import EvaluateStage, evaluate_model

    rows = []
    for name, path, temps in _policies(config, ctx):
        for temp in temps:
            spec = EvaluateStage(models={name: path}, env="clarify", env_options=config.env_options,
                                 episodes=config.episodes, seed_start=10_000_000, temperature=temp,
                                 sample_seed=config.seed, max_steps=config.max_turns,
                                 extra_keys=["questions", "uninformative_questions"])
            summary, _ = evaluate_model(name, path, spec)
            rows.append({**summary, "temperature": temp})
    table = Table(title=config.title)
    for col in ("policy", "eval", "success", "95% CI", "questions", "uninformative", "turns"):
        table.add_column(col)
    for r in sorted(rows, key=lambda r: r["temperature"]):
        table.add_row(r["name"], "greedy" if r["temperature"] == 0 else f"T={r['temperature']:g}",
                      f"{r['success']:.3f}", f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]", f"{r['questions']:.2f}",
                      f"{r['uninformative_questions']:.3f}", f"{r['mean_turns']:.2f}")
    Console().print(table)
    history = {arm: ctx.outputs[f"grpo-{arm}"]["history"] for arm in config.arms}
    Path(config.results).write_text(json.dumps({"rows": rows, "env_options": config.env_options, **config.extra,
                                                "history": history}, indent=2, default=str))
    ctx.log(f"results: {config.results}")
    return {"rows": rows, "results": config.results}


EVALUATE = StageKind(Evaluate, _evaluate, "greedy and sampled held-out evaluation of every policy")
