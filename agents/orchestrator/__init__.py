"""LLM Orchestration (paper 4): the control-token grammar, configured experts, and the interaction
layer (streamed speech, barge-in). The graph is :mod:`closedloop.graphs.orchestrator`; the memory
is :mod:`closedloop.memory.cross_modal`."""

from closedloop.agents.orchestrator.experts import ExpertPool, ExpertSpec, OrchestratorConfig, load_config
from closedloop.agents.orchestrator.grammar import Call, GrammarError, Interrupt, Listen, Speak, parse_program

__all__ = ["ExpertPool", "ExpertSpec", "OrchestratorConfig", "load_config", "Call", "GrammarError", "Interrupt",
           "Listen", "Speak", "parse_program"]
