"""closedloop: agent graphs, evaluation and training in one loop."""
__version__ = "0.1.0"
