"""kill -9 in the middle of a run, then --resume: every algorithm file ends with the metrics, the evaluation scores
and the exported weights of an uninterrupted run, bit for bit on a CPU (tiny random Flux pipeline)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, read_metrics, run_script, tiny_flags

pytestmark = pytest.mark.slow

ITERATIONS = 4
CASES = {  # name: (script, flags on top of tiny_flags at T = 4); DanceGRPO's lineage: MixGRPO-Flash (its window moves)
    "flow_grpo": ("flow_grpo.py", {}),
    "densegrpo": ("densegrpo.py", {"dense_ode_steps": 2}),
    "mixgrpo_flash": ("mixgrpo.py", {"flash": True, "window_size": 2, "window_shift_interval": 3,
                                     "updates_per_iteration": 1}),
    "awm": ("awm.py", {"train_timesteps": 2}),  # its KL-EMA copy in state.pt (DiffusionNFT's old policy: the same path)
    "dgpo": ("dgpo.py", {"trunc_steps": 2, "train_timesteps": 2}),  # its EMA reference in state.pt
    "flow_dppo": ("flow_dppo.py", {"sde_steps": 1}),  # its SDE steps drawn anew each iteration
    "dpo": ("dpo.py", {"timestep_fraction": 0.5, "ref_update_step": 3}),  # its reference, copied at step 3, in state.pt
    "crd": ("crd.py", {"train_timesteps": 2}),  # its old and sampling snapshots in state.pt, two steps an iteration
}


def weights(run):
    """Every tensor of the newest exported model (LoRA or transformer), by file and name."""
    ckpt = os.path.join(run, "checkpoints", f"iter_{ITERATIONS}")
    out = {}
    for root, _, files in os.walk(ckpt):
        for f in files:
            if f.endswith(".safetensors"):
                out.update({f"{f}:{k}": v for k, v in load_file(os.path.join(root, f)).items()})
    return out


@pytest.mark.parametrize("case", CASES)
def test_kill_9_and_resume_equals_the_uninterrupted_run(tiny, tmp_path, case):
    script, over = CASES[case]
    flags = dict(over, num_iterations=ITERATIONS, eval_every=2, save_every=1, ema_every=1, log_images_every=0)
    run_script(script, tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "full", **flags))
    part = tmp_path / "part"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, script),
                             *tiny_flags(tiny["flux"], tiny["prompts"], part, **flags)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (part.is_dir() and any(
            (part / r / "checkpoints" / "iter_2").is_dir() for r in os.listdir(part))):
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # wherever it is: training, evaluating or writing the next checkpoint
    proc.wait()
    run, _ = read_metrics(part)
    assert not os.path.isdir(os.path.join(run, "checkpoints", f"iter_{ITERATIONS}")), "killed too late"
    run_script(script, tiny_flags(tiny["flux"], tiny["prompts"], part, resume=run, **flags))
    full, _ = read_metrics(tmp_path / "full")
    rows = [[{k: v for k, v in json.loads(line).items() if "seconds" not in k}
             for line in open(os.path.join(r, "metrics.jsonl"))] for r in (full, run)]
    assert rows[0] == rows[1]  # the same lines in the same order: nothing the killed run logged is left twice
    for i in range(0, ITERATIONS + 1, 2):
        assert json.load(open(os.path.join(full, f"eval_{i}.json"))) == json.load(open(os.path.join(run, f"eval_{i}.json")))
    a, b = weights(full), weights(run)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
