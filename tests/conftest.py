import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "toy")]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process, learning and end-to-end runs (skip with -m 'not slow')")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny random Flux and SD3 pipelines on disk (and a prompt file), built once per test session."""
    from helpers import tiny_model_dirs

    return tiny_model_dirs(str(tmp_path_factory.mktemp("tiny")))
