import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "toy")]
os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers share the cores: one thread each, as the runs use


def pytest_configure(config):
    import torch
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny random Flux and SD3 pipelines on disk (and a prompt file), built once per test session."""
    from helpers import tiny_model_dirs

    return tiny_model_dirs(str(tmp_path_factory.mktemp("tiny")))


def pytest_collection_modifyitems(items):
    """The learning runs first: they are the longest file, and one worker runs them while the other runs the rest."""
    items.sort(key=lambda item: "test_learning.py" not in item.nodeid)
