"""Session-wide fixtures: the tiny tool-calling model, built once per test session (offline, CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def anchors_root() -> Path | None:
    """The real tau2 data shipped beside the repository (../shared/anchors), or $TAU2_DATA_DIR."""
    for cand in (os.environ.get("TAU2_DATA_DIR"), REPO.parent / "shared" / "anchors"):
        if cand and (Path(cand) / "tau2" / "domains" / "retail").is_dir():
            return Path(cand)
    return None


TINY_STEPS = 500  # the default build


def _cached_tiny(request, name: str, **build_kwargs) -> Path:
    """A tiny model built once per version of ``tiny.py`` and build settings, kept in pytest's cache."""
    import hashlib
    import shutil

    import torch

    from closedloop.models import tiny
    from closedloop.models.tiny import TINY_CONFIG_FILE, build_tiny_model

    # A 2-core machine: extra OpenMP threads spin against each other and slow everything down.
    torch.set_num_threads(1)
    key = hashlib.sha256(Path(tiny.__file__).read_bytes() + repr(sorted(build_kwargs.items())).encode()).hexdigest()[:12]
    cached = Path(request.config.cache.mkdir(f"closedloop-{name}-{key}"))
    if not (cached / TINY_CONFIG_FILE).exists():  # written last: its presence means a whole build
        staging = cached.with_name(cached.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        build_tiny_model(staging, **build_kwargs)
        shutil.rmtree(cached)
        staging.rename(cached)
        for stale in cached.parent.glob(f"closedloop-{name}-*"):
            if stale != cached and not stale.name.endswith(".building"):
                shutil.rmtree(stale, ignore_errors=True)
    return cached


@pytest.fixture(scope="session")
def tiny_model_path(request) -> Path:
    """The tiny tool-calling model (``CLOSEDLOOP_TINY_MODEL=<dir>`` points at a prebuilt one)."""
    if os.environ.get("CLOSEDLOOP_TINY_MODEL"):
        return Path(os.environ["CLOSEDLOOP_TINY_MODEL"])
    return _cached_tiny(request, "tiny", seed=0, train_steps=TINY_STEPS)


@pytest.fixture(scope="session")
def tiny_vlm_path(tiny_model_path, tmp_path_factory) -> Path:
    """A tiny LLaVA-architecture VLM whose language half is the tiny text model (built in seconds)."""
    from closedloop.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), tiny_model_path, seed=0)


@pytest.fixture(scope="session")
def tiny_asr_path(tmp_path_factory) -> Path:
    """A tiny Whisper that says "hello world" for any audio (built in seconds)."""
    from closedloop.models.tiny_asr import build_tiny_asr

    return build_tiny_asr(tmp_path_factory.mktemp("tiny-asr") / "asr")


@pytest.fixture(scope="session")
def scorer_model_path(request) -> Path:
    """The tiny architecture trained only on goal restatement: the frozen scorer of the
    information-gain tests. (Mixed with tool use, the 150k-parameter model learns restating
    too unreliably to test IG; trained on restating alone it needs ~1500 steps to learn copying the
    answer's detail.) Label smoothing 0.2 puts goals the conversation rules out on a common floor
    (log(0.2/V), about -8 nats) instead of arbitrary far-tail values, so an uninformative answer's
    IG is a difference of two floors: seeds 0-3 gave informative IG >= 7.7 nats and |uninformative
    IG| <= 0.8 (without smoothing, uninformative IG reached 2.3-2.7 nats on seeds 0 and 2)."""
    return _cached_tiny(request, "scorer", seed=0, goal_weight=1000.0, train_steps=1500, label_smoothing=0.2)


@pytest.fixture(scope="session")
def tiny_client(tiny_model_path):
    from closedloop.models.hf import HFClient

    return HFClient.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session", autouse=True)
def _tmp_dirs_inside_the_working_root(tmp_path_factory):
    """Tests hand tools files under pytest's tmp_path; the working root (closedloop.paths) is
    widened to it as a user would with CLOSEDLOOP_WORKING_ROOTS. Tests of the root itself unset it."""
    previous = os.environ.get("CLOSEDLOOP_WORKING_ROOTS")
    base = str(tmp_path_factory.getbasetemp())
    os.environ["CLOSEDLOOP_WORKING_ROOTS"] = os.pathsep.join(p for p in (previous, base) if p)
    yield
    if previous is None:
        os.environ.pop("CLOSEDLOOP_WORKING_ROOTS", None)
    else:
        os.environ["CLOSEDLOOP_WORKING_ROOTS"] = previous
