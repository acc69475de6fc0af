"""The information-gain clarifier (Deng et al., ICML 2026, "Uncertainty-Aware Clarification in LLM
Agents with Information Gain"): ask a clarifying question only when the goal is ambiguous.

- :mod:`.scorer`: a frozen teacher-forcing scorer, log p(g | conversation).
- :mod:`.reward`: the information-gain reward IG = log p(g* | h, q, a) − log p(g* | h).
- :mod:`.belief`: a Bayesian belief over candidate goals, updated from the same scorer.
"""
