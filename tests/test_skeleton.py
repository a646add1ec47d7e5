"""The skeleton's budgets, checked against the tree: each algorithm file's loop and imports, each diff to its parent
as docs/contributing.md states it, the shared functions' parameters, and the README's test counts."""
import ast
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT

PARENTS = {"densegrpo": "flow_grpo", "diffusion_nft": "flow_grpo", "awm": "flow_grpo", "dancegrpo": "flow_grpo",
           "g2rpo": "dancegrpo", "mixgrpo": "dancegrpo", "dgpo": "awm", "flow_dppo": "flow_grpo", "dpo": "flow_grpo",
           "crd": "diffusion_nft"}
FILES = ["flow_grpo", *PARENTS]


def source(name):
    with open(os.path.join(ROOT, f"{name}.py")) as f:
        return f.read()


def changed_lines(a, b):
    """The lines `diff a.py b.py` prints with < or >."""
    out = subprocess.run(["diff", f"{a}.py", f"{b}.py"], cwd=ROOT, capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line[:1] in "<>")


@pytest.mark.parametrize("name", FILES)
def test_the_loop_is_the_algorithm_and_the_imports_are_few(name):
    tree = ast.parse(source(name))
    imported = sum(len(node.names) for node in tree.body
                   if isinstance(node, ast.ImportFrom) and node.module in ("common", "rundir"))
    assert imported <= 25, imported
    main = [node for node in tree.body if isinstance(node, ast.If)][-1]
    (loop,) = [node for node in main.body if isinstance(node, ast.For) and ast.unparse(node.target) == "iteration"]
    lines = [line for line in source(name).splitlines()[loop.lineno - 1:loop.end_lineno] if line.strip()]
    assert len(lines) <= 110, len(lines)
    assert "run.end_iteration(" in "\n".join(lines) and "rank_chunks" not in "\n".join(lines)
    for marker in ("# ALGO LOGIC: rollout", "# ALGO LOGIC: policy update", "# TRY NOT TO MODIFY: logging"):
        assert marker in "\n".join(lines), marker


def test_the_diffs_to_the_parents_are_the_documented_ones():
    """docs/contributing.md's table of diff sizes is the tree's (it cannot go stale)."""
    with open(os.path.join(ROOT, "docs", "contributing.md")) as f:
        rows = re.findall(r"^\| `(\w+)\.py` \| `(\w+)\.py` \| (\d+) \|", f.read(), flags=re.M)
    assert {child: (parent, int(n)) for child, parent, n in rows} == {
        child: (parent, changed_lines(parent, child)) for child, parent in PARENTS.items()}


@pytest.mark.parametrize("module", ["common", "rundir", "rewards"])
def test_shared_functions_take_few_parameters(module):
    with open(os.path.join(ROOT, f"{module}.py")) as f:
        tree = ast.parse(f.read())
    many = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            count = len(node.args.args) + len(node.args.kwonlyargs) + len(node.args.posonlyargs)
            if count > 8:
                many[node.name] = count
    expected = {"ode_complete": 11} if module == "common" else {}  # the model, the rows, their paths and extras
    assert many == expected, many


def test_the_readme_states_the_collected_test_counts():
    # one collection gives both: "393/503 tests collected (110 deselected)"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "not slow"],
                          cwd=ROOT, capture_output=True, text=True)
    fast, whole = map(int, re.search(r"(\d+)/(\d+) tests collected", proc.stdout).groups())
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert f"whole suite ({whole} tests" in readme and f"runs the {fast} tests" in readme, (whole, fast)
