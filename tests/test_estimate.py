"""results/estimate.py on tiny architectures: the same code paths as the full estimate (fake tensors, FSDP2 over a fake
process group, the algorithm files' own Args and closed-form NFE), in seconds, so that it cannot rot."""
import os
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "results"))
import estimate  # noqa: E402


def command(prefix):
    return next(c for c in estimate.COMMANDS if c[0].startswith(prefix))


def test_sharded_and_lora_state_is_accounted():
    """Full fine-tuning over 16 ranks holds 1/16 of the float32 weights (FSDP2 pads each tensor's shard) and twice that
    in Adam states; LoRA holds the whole bf16 model plus float32 adapters; the rollout gathers bf16 weights."""
    name, script, argv, world = command("G2RPO")
    sharded = estimate.estimate(name, script, argv, world, tiny=True)
    n = sharded["n_params"]
    b = sharded["bytes"]
    assert b["frozen transformer (bf16)"] == 0 and 4 * n / world <= b["trainable (float32)"] <= 4 * n / world * 1.2
    assert b["Adam states"] == pytest.approx(2 * b["trainable (float32)"], rel=0.01)
    resident = sum(v for k, v in b.items() if not k.startswith("text"))
    assert sharded["peak"]["rollout"] >= resident + 2 * n * (world - 1) / world  # every block gathered in bf16
    assert sharded["nfe"] == __import__("g2rpo").planned_nfe(sharded["args"])  # read from the file, not re-typed
    name, script, argv, world = command("1 GPU: G2RPO")
    lora = estimate.estimate(name, script, argv, world, tiny=True)
    frozen, trainable = lora["bytes"]["frozen transformer (bf16)"], lora["bytes"]["trainable (float32)"]
    assert frozen == pytest.approx(2 * lora["n_params"], rel=0.01) and trainable > 0  # (tiny: r 64 adapters are large)
    per_row_train, per_row_forward = lora["flops"]["training step"], lora["flops"]["rollout"] / (2 * lora["mb"])
    assert per_row_train > 2 * per_row_forward > 0 and estimate.per_iteration(lora) > 0  # backward ~ 2 forwards


def test_undoing_a_change_never_lowers_the_peak():
    name, script, argv, world = command("DenseGRPO, SD3.5-M, PickScore")
    e = estimate.estimate(name, script, argv, world, tiny=True)
    now = estimate.peak(e)
    assert estimate.peak(e, ("text encoders off the GPU",)) == pytest.approx(
        now + e["bytes"]["text encoders (on the CPU between encodings)"] / estimate.GIB)
    assert estimate.peak(e, ("indexed embeddings",)) > now
    undone = estimate.undone(name, script, argv, world, True, e)
    assert set(undone) >= {"activation checkpointing", "text encoders off the GPU", "indexed embeddings"}
    assert all(v >= now - 1e-9 for v in undone.values()), undone


@pytest.mark.slow
def test_estimate_script_writes_every_command(tmp_path):
    out = tmp_path / "estimate.md"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "results", "estimate.py"), "--tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for name, *_ in estimate.COMMANDS:
        assert text.count(f"| {name} |") == 3, name  # the peak table, the resident table, the before/after table


def test_gpu_check_script_runs_on_a_tiny_model():
    """results/gpu_check.py is what a session with a GPU runs to check the estimate; its code path works on a CPU."""
    import json

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "results", "gpu_check.py"), "--tiny"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    assert out["lora gradients"] > 0 and "training step peak GiB" in out
