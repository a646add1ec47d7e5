"""Ctrl-C (SIGINT) and SIGTERM: during an iteration the run finishes it, saves it and stops with one line and the
command that continues it (exit 130 / 143), and `--resume DIR` alone continues it bit for bit; a second signal stops
at once with the last checkpoint intact; a signal or a failure before the first iteration leaves no run directory.
The signals are sent by the run's own process at a chosen model call (mid-rollout: a no-grad forward of the
iteration; mid-update: a forward with a gradient), so the moment is exact."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, read_metrics, run_script, tiny_flags

pytestmark = pytest.mark.slow

LAUNCHER = """
import os, runpy, sys
import torch
sys.path.insert(0, {root!r})
import common
where, at_iteration, times, signum, swallow = {where!r}, {at_iteration}, {times}, {signum}, {swallow}
real_generator, real_velocity, state = common.iteration_generator, common.velocity, {{"iteration": -1, "sent": 0}}

def iteration_generator(seed, iteration, rank, stream=0):  # the loop draws stream 0 first: its iteration
    state["iteration"] = iteration if stream == 0 else state["iteration"]
    return real_generator(seed, iteration, rank, stream)

def velocity(*args, **kwargs):
    if state["iteration"] == at_iteration and torch.is_grad_enabled() == (where == "update") and \\
            state["sent"] < times:
        state["sent"] += 1
        try:
            os.kill(os.getpid(), signum)
            for _ in range(2):  # the handler runs here, at a loop's jump back
                pass
        except SystemExit:  # as a __del__ or a callback would swallow it
            if not swallow:
                raise
    return real_velocity(*args, **kwargs)

common.iteration_generator, common.velocity = iteration_generator, velocity
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
FLAGS = dict(num_iterations=3, eval_every=3, save_every=3, ema_every=1, log_images_every=0)


def interrupted(tmp_path, flags, *, where, at_iteration, times=1, signum=signal.SIGINT, swallow=False):
    """flow_grpo.py with `flags`, signalled `times` times at its first model calls of `where` in iteration
    `at_iteration` (0-based; -1: the base model's evaluation); `swallow`: the stop's SystemExit is caught there."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER.format(root=ROOT, where=where, at_iteration=at_iteration, times=times,
                                        signum=int(signum), swallow=swallow))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, str(launcher), os.path.join(ROOT, "flow_grpo.py"), *flags], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def exported(run, iteration):
    path = os.path.join(run, "checkpoints", f"iter_{iteration}", "lora", "pytorch_lora_weights.safetensors")
    return load_file(path)


def same_run(full, resumed):
    """The same metrics lines (times aside), evaluations and exported weights."""
    rows = [[{k: v for k, v in json.loads(line).items() if "seconds" not in k}
             for line in open(os.path.join(r, "metrics.jsonl"))] for r in (full, resumed)]
    assert rows[0] == rows[1]
    assert json.load(open(os.path.join(full, "eval_3.json"))) == json.load(open(os.path.join(resumed, "eval_3.json")))
    a, b = exported(full, 3), exported(resumed, 3)
    assert a.keys() == b.keys() and len(a) > 0 and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], out, **FLAGS))
    return read_metrics(out)[0]


@pytest.mark.parametrize("where,signum", [("rollout", signal.SIGINT), ("update", signal.SIGTERM)])
def test_a_signal_stops_after_the_iteration_and_resume_alone_continues_bit_for_bit(tiny, tmp_path, uninterrupted,
                                                                                    where, signum):
    out = tmp_path / "part"
    proc = interrupted(tmp_path, tiny_flags(tiny["flux"], tiny["prompts"], out, **FLAGS), where=where, at_iteration=1,
                       signum=signum)
    assert proc.returncode == 128 + signum, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    run, _ = read_metrics(out)
    name = signal.Signals(signum).name
    assert proc.stdout.strip().splitlines()[-1] == (
        f"stopped by {name} after iteration 2 (checkpoint {run}/checkpoints/iter_2); continue with: python "
        f"flow_grpo.py --resume {run}")
    assert f"{name}: the run stops when this iteration is done and saved" in proc.stderr + proc.stdout
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["iter_2"]  # saved although --save-every 3
    run_script("flow_grpo.py", ["--resume", run])  # its checkpoint's arguments
    same_run(uninterrupted, run)


def test_a_second_signal_stops_at_once_and_the_last_checkpoint_resumes(tiny, tmp_path, uninterrupted):
    out = tmp_path / "part"
    flags = tiny_flags(tiny["flux"], tiny["prompts"], out, **{**FLAGS, "save_every": 1})
    proc = interrupted(tmp_path, flags, where="rollout", at_iteration=1, times=2)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    run, _ = read_metrics(out)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stopped by SIGINT again; its checkpoint {run}/checkpoints/iter_1 resumes (--resume {run})")
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["iter_1"]
    run_script("flow_grpo.py", ["--resume", run, "--save-every", "3"])
    same_run(uninterrupted, run)


def test_nothing_is_left_of_a_run_stopped_or_failed_before_its_first_iteration(tiny, tmp_path):
    out = tmp_path / "out"
    proc = interrupted(tmp_path, tiny_flags(tiny["flux"], tiny["prompts"], out, **FLAGS), where="rollout",
                       at_iteration=-1)  # in the base model's evaluation
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == "stopped by SIGINT"
    assert os.listdir(out) == []
    swallowed = interrupted(tmp_path, tiny_flags(tiny["flux"], tiny["prompts"], out, **FLAGS), where="rollout",
                            at_iteration=-1, signum=signal.SIGTERM, swallow=True)  # the run still stops
    assert swallowed.returncode == 143 and "Traceback" not in swallowed.stderr, swallowed.stderr[-3000:]
    assert "training: iterations" not in swallowed.stdout + swallowed.stderr
    assert os.listdir(out) == []
    first = interrupted(tmp_path, tiny_flags(tiny["flux"], tiny["prompts"], out, **FLAGS), where="update",
                        at_iteration=0, times=2)  # twice in the first iteration: nothing saved yet
    assert first.returncode == 130 and first.stderr.strip().splitlines()[-1].startswith(
        "stopped by SIGINT again; no iteration was saved yet, so ")
    assert os.listdir(out) == []
    broken = tmp_path / "not-a-pipeline"
    broken.mkdir()
    (broken / "model_index.json").write_text("{}")
    failed = run_script("flow_grpo.py", tiny_flags(str(broken), tiny["prompts"], out, **FLAGS), check=False)
    assert failed.returncode == 1 and failed.stderr.strip().splitlines()[-1].startswith("error: cannot load model")
    assert os.listdir(out) == []  # the directory made before the model loaded is gone
