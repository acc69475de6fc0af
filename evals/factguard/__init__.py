"""FactGuard (paper 1): data, the environment, and its evaluation."""
