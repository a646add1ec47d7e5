"""Runs of this project's scripts one after another in one interpreter, torch and diffusers imported once
(6 CPU-s a process), as tests/helpers.run_here runs one:

    python tests/run_in_turn.py RUNS.json   # a list of [name, script, [argument, ...]]

Each run's exit code (first line) and output go to NAME.log beside RUNS.json."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "toy")]

from helpers import run_here  # noqa: E402

if __name__ == "__main__":
    for name, script, args in json.load(open(sys.argv[1])):
        proc = run_here(script, args)
        with open(os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), f"{name}.log"), "w") as f:
            f.write(f"{proc.returncode}\n{proc.stdout}{proc.stderr}")
