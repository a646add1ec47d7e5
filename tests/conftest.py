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


# the files of most CPU seconds (measured with PYTEST_CPU_LOG, docs/contributing.md), most first
HEAVY = ("test_learning.py", "test_estimate.py", "test_compare.py", "test_flow_grpo.py", "test_resume.py",
         "test_bad_input.py", "test_memory.py", "test_families.py", "test_baselines.py", "test_interrupt.py",
         "test_robustness.py", "test_diffusion_nft.py", "test_stats.py")


def pytest_collection_modifyitems(items):
    """The learning runs first: they are the longest file, and one worker starts with it (its process runs the
    three toy worlds' learning runs) while the other worker runs the rest; then the other files of most CPU
    seconds, so that the last files the two workers share are short ones (pytest-xdist hands out whole files,
    in this order)."""
    rank = lambda item: next((i for i, f in enumerate(HEAVY) if f"/{f}::" in f"/{item.nodeid}"), len(HEAVY))  # noqa
    items.sort(key=rank)


CPU_LOG = os.environ.get("PYTEST_CPU_LOG")  # a JSON line per test, its CPU seconds (docs/contributing.md)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With $PYTEST_CPU_LOG set: the CPU seconds of each test (setup, call and teardown together), this
    process's, those of the processes it waited for and of the fork server's work for it (its imports, in the
    test that started it, and the ranks it forked), which a busy machine inflates far less than its wall-clock
    seconds."""
    if not CPU_LOG:
        yield
        return
    import json
    import resource

    import helpers

    def cpu():
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        forked = helpers.FORKED_CPU[0]  # tests/fork_server.py's and its ranks': not this process's children
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked

    start = cpu()
    yield
    with open(CPU_LOG, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_seconds": round(cpu() - start, 2)}) + "\n")
