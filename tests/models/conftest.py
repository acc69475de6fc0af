"""Shared fixtures: the tiny tool-calling model, built once per test session (offline, CPU)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    import torch

    from closedloop.models.tiny import build_tiny_model

    # A shared 2-core machine: extra OpenMP threads spin against each other and slow everything.
    torch.set_num_threads(1)
    # 300 warm-up steps (the default is 500) already give well-formed calls; it halves the build.
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, train_steps=300)


@pytest.fixture(scope="session")
def tiny_client(tiny_model_path):
    from closedloop.models.hf import HFClient

    return HFClient.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tools():
    from closedloop.models.tiny import tool_schemas

    return tool_schemas()
