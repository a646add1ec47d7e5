import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "toy")]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process, learning and end-to-end runs (skip with -m 'not slow')")
