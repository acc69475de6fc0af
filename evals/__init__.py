"""closedloop.evals"""
