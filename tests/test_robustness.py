"""What a careless or hostile environment does to a run, and the one line it gets instead: run directories that
one process group owns (an OS lock that dies with its holder), distinct directories for runs started in the same
second, files replaced whole under kill -9, a --num-iterations that a checkpoint has already reached, a disk that
fills or turns read-only mid-run, torchrun environments that cannot form a group, and prompt files whose prompts
are not text. (Reward servers that stall, drop or send nonsense: tests/test_reward_server.py.)"""
import errno
import os
import random
import signal
import socket
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import rundir
from common import load_prompt_set
from helpers import ROOT, run_script, tiny_flags


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """A 2-iteration LoRA run on the tiny Flux with a checkpoint after each iteration: (its directory, its flags)."""
    out = tmp_path_factory.mktemp("robust")
    flags = dict(num_iterations=2, eval_every=2, save_every=1, log_images_every=0)
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], out, **flags))
    (name,) = os.listdir(out)
    return str(out / name), lambda **over: tiny_flags(tiny["flux"], tiny["prompts"], out, **{**flags, **over})


def error_line(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines, (proc.stdout[-2000:], proc.stderr[-2000:])
    return lines[-1]


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.time, "time", lambda: 1796400000.0)
    args = types.SimpleNamespace(model="toy", exp_name="flow_grpo", seed=0, output_dir=str(tmp_path))
    try:
        first = rundir.run_directory(args, checkpoint=None)
        second = rundir.run_directory(args, checkpoint=None)
    finally:
        rundir.release_run_directories()
    assert first == str(tmp_path / "toy__flow_grpo__0__1796400000") and second == first + "_2"
    with ThreadPoolExecutor(8) as pool:  # racing for one name: os.mkdir lets exactly one win each
        made = list(pool.map(lambda _: rundir.new_directory(str(tmp_path / "race")), range(8)))
    assert sorted(made) == sorted([str(tmp_path / "race")] + [str(tmp_path / f"race_{k}") for k in range(2, 9)])


def test_a_run_directory_is_owned_by_one_process_until_it_dies(run, tmp_path):
    """A second run (here: a --resume) of a directory that a live process holds stops in one line naming that
    process; once the holder is killed with kill -9 the OS has dropped the lock and the resume runs."""
    run_dir, flags = run
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "import rundir; assert rundir.hold_run_directory(sys.argv[2]) is None; "
                               "print('held', flush=True); time.sleep(600)", ROOT, run_dir],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = run_script("flow_grpo.py", flags(resume=run_dir, num_iterations=3), check=False)
        line = error_line(proc)
        assert line.startswith(f"error: run directory {run_dir!r} is in use by pid {holder.pid} on "
                               f"{socket.gethostname()} since ")
        assert line.endswith("; wait until that run ends or stop it (two runs in one directory would mix their logs "
                             "and checkpoints)")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    rows = rundir.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert max(r["iteration"] for r in rows) == 2  # the refused resume wrote nothing
    proc = run_script("flow_grpo.py", flags(resume=run_dir, num_iterations=3, eval_every=0))
    assert max(r["iteration"] for r in rundir.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))) == 3
    assert rundir.latest_checkpoint(run_dir).endswith("iter_3")


def test_num_iterations_must_go_beyond_the_checkpoint(run):
    run_dir, flags = run
    ckpt = rundir.latest_checkpoint(run_dir)
    n = rundir.iteration_of(ckpt)
    proc = run_script("flow_grpo.py", flags(resume=run_dir, num_iterations=n), check=False)
    assert error_line(proc) == (f"error: --num-iterations {n} is not beyond checkpoint {ckpt!r} (iteration {n}); pass "
                                f"the total number of iterations to reach, more than {n}")


WRITER = """
import sys
sys.path.insert(0, sys.argv[1])
import rundir
path, k = sys.argv[2], 0
print("writing", flush=True)
while True:
    k += 1
    rundir.write_atomically(path, ("A" if k % 2 else "B") * (1 << 20) * (1 + k % 2))
"""


def test_a_file_replaced_atomically_survives_kill_9_anywhere(tmp_path):
    """metrics.jsonl (rewritten by every resume), eval_<i>.json, grids, psi.json and evaluate.py's outputs are
    written by rundir.write_atomically: killed at random moments mid-write, the file is always one whole version."""
    path = str(tmp_path / "metrics.jsonl")
    rundir.write_atomically(path, "A" * (1 << 20) * 2)
    rng = random.Random(0)
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, ROOT, path], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "writing"
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        content = open(path).read()
        assert content in ("A" * (1 << 20) * 2, "B" * (1 << 20)), (len(content), content[:1], content[-1:])
    leftovers = [f for f in os.listdir(tmp_path) if ".tmp" in f]
    assert leftovers  # a killed writer's temporary file: the next run that holds the directory removes it
    os.makedirs(tmp_path / "checkpoints" / "iter_3.tmp")
    try:
        assert rundir.hold_run_directory(str(tmp_path)) is None
    finally:
        rundir.release_run_directories()
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f] and os.listdir(tmp_path / "checkpoints") == []


def test_a_full_disk_at_a_checkpoint_stops_in_one_line_and_the_last_one_resumes(tiny, tmp_path, monkeypatch):
    """The second checkpoint's state.pt meets ENOSPC as torch's stream writer meets it (the OSError of its write
    under a RuntimeError "unexpected pos"): one line saying so, naming the checkpoint, no iter_2.tmp left behind,
    and --resume continues from iter_1."""
    import torch
    real_save, calls = torch.save, []

    def save(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 2:
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    flags = dict(num_iterations=2, eval_every=0, save_every=1, log_images_every=0)
    proc = run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, **flags), check=False)
    (name,) = os.listdir(tmp_path)
    run_dir = str(tmp_path / name)
    state = os.path.join(run_dir, "checkpoints", "iter_2.tmp")
    assert error_line(proc) == (f"error: cannot write {state!r} (No space left on device): the run stops here; its "
                                f"last complete checkpoint resumes: --resume {run_dir}")
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["iter_1"]
    monkeypatch.setattr(torch, "save", real_save)
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, resume=run_dir, **flags))
    assert rundir.latest_checkpoint(run_dir).endswith("iter_2")


def test_a_read_only_log_stops_in_one_line(tiny, tmp_path, monkeypatch):
    """EROFS from the metrics log (or TensorBoard's writer, the same wrapper) in the middle of a run."""
    real = rundir.log_metrics

    def log_metrics(writer, run_dir, step, *a, **k):
        if step == 2:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(run_dir, "metrics.jsonl"))
        return real(writer, run_dir, step, *a, **k)

    monkeypatch.setattr(rundir, "log_metrics", log_metrics)
    flags = dict(num_iterations=3, eval_every=0, save_every=1, log_images_every=0)
    proc = run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, **flags), check=False)
    (name,) = os.listdir(tmp_path)
    run_dir = str(tmp_path / name)
    assert error_line(proc) == (f"error: cannot write {os.path.join(run_dir, 'metrics.jsonl')!r} (Read-only file "
                                f"system): the run stops here; its last complete checkpoint resumes: --resume "
                                f"{run_dir}")


def distributed_error(env_over, timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    code = "import sys; sys.path.insert(0, sys.argv[1]); import common; common.setup_distributed(); print('formed')"
    t = time.time()
    proc = subprocess.run([sys.executable, "-c", code, ROOT], env={**env, **env_over}, capture_output=True,
                          text=True, timeout=timeout)
    return error_line(proc), time.time() - t


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "2"}, "error: WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT not (left in the shell by "
                          "a torchrun run?); launch with torchrun, or unset WORLD_SIZE for one process"),
    ({"WORLD_SIZE": "two"}, "error: WORLD_SIZE='two' in the environment is not a number in [1, 1000000]; launch "
                            "with torchrun, or unset it"),
    ({"WORLD_SIZE": "0"}, "error: WORLD_SIZE='0' in the environment is not a number in [1, 1000000]; launch with "
                          "torchrun, or unset it"),
    ({"WORLD_SIZE": "9" * 5000}, "error: WORLD_SIZE='" + "9" * 12 + "..." + "9" * 13 + "' in the environment is not a "
                                 "number in [1, 1000000]; launch with torchrun, or unset it"),
    ({"MASTER_PORT": "70000"}, "error: MASTER_PORT='70000' in the environment is not a number in [1, 65535]; launch "
                               "with torchrun, or unset it"),
    ({"RANK": "\x1b[2J"}, "error: RANK='\\x1b[2J' in the environment is not a number in [0, 1000000]; launch with "
                          "torchrun, or unset it"),
    ({"RENDEZVOUS_TIMEOUT": "abc"}, "error: RENDEZVOUS_TIMEOUT='abc' in the environment is not a number of seconds "
                                    "in (0, 86400]"),
    ({"RENDEZVOUS_TIMEOUT": "inf"}, "error: RENDEZVOUS_TIMEOUT='inf' in the environment is not a number of seconds "
                                    "in (0, 86400]"),
    ({"RENDEZVOUS_TIMEOUT": "0"}, "error: RENDEZVOUS_TIMEOUT='0' in the environment is not a number of seconds "
                                  "in (0, 86400]"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "error: RANK=2 is not below WORLD_SIZE=2; launch with torchrun"),
])
def test_a_torchrun_environment_that_cannot_form_a_group(env, message):
    assert distributed_error(env)[0] == message


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_rank_without_peers_stops_within_the_rendezvous_timeout(rank):
    """A stale torchrun shell: every variable set, no other rank. Rank 0 hosts the store and waits for the
    others, rank 1 finds no store; each stops after $RENDEZVOUS_TIMEOUT (default 300 s) instead of an hour."""
    port = free_port()
    line, took = distributed_error({"WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": str(port), "RENDEZVOUS_TIMEOUT": "2"})
    assert line.startswith(f"error: rank {rank} of WORLD_SIZE=2 found no group at 127.0.0.1:{port} within 2 s (")
    assert line.endswith("); start every rank (torchrun), unset WORLD_SIZE for one process, or raise "
                         "$RENDEZVOUS_TIMEOUT")
    assert took < 40


@pytest.mark.parametrize("line,shown", [('{"prompt": null}', "null"), ('{"prompt": 12345}', "12345"),
                                        ('{"prompt": ["a", "b"]}', '["a", "b"]'), ('{"prompt": ""}', '""'),
                                        ('{"prompt": "   "}', '"   "')])
def test_a_prompt_that_is_no_text_is_refused_with_its_line(tmp_path, line, shown):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a dog"}\n\n' + line + "\n")
    with pytest.raises(SystemExit) as e:
        load_prompt_set(str(path))
    assert str(e.value) == (f"error: line 3 of prompt file {str(path)!r} has the prompt {shown}; a prompt must be a "
                            f"non-empty string")
    path.write_text('{"prompt": "a dog"}\n[1, 2]\n')
    with pytest.raises(SystemExit, match=r"^error: line 2 of prompt file .* is not a JSON object with a prompt field"):
        load_prompt_set(str(path))


def test_the_lock_names_its_holder_in_the_file(tmp_path):
    try:
        assert rundir.hold_run_directory(str(tmp_path)) is None
        text = open(tmp_path / "run.lock").read()
        assert text.startswith(f"pid {os.getpid()} on {socket.gethostname()} since ")
        assert rundir.hold_run_directory(str(tmp_path)) is not None  # a second open file description: refused
    finally:
        rundir.release_run_directories()


def test_evaluate_checks_that_every_export_fits_before_scoring_anything(tiny, tmp_path):
    """A LoRA copied away from its run (no run.json to name its model) onto another architecture, and a transformer
    export whose tensors do not match: one line each, after the model loads and before the base model is scored."""
    from safetensors.torch import save_file

    import evaluate
    lora = tmp_path / "lora"
    lora.mkdir()
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 999),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 4)},
              str(lora / evaluate.LORA_FILE))
    proc = run_script("evaluate.py", ["--model", tiny["flux"], "--prompts", tiny["prompts"], "--checkpoints", str(lora),
                                      "--metrics", "jpeg", "--resolution", "32", "--steps", "2", "--out",
                                      str(tmp_path / "out"), "--mixed-precision", "no"], check=False)
    assert error_line(proc) == (f"error: --checkpoints {str(lora)!r} does not fit --model {tiny['flux']!r}: "
                                f"transformer.transformer_blocks.0.attn.to_q.lora_A.weight is [4, 999], for a layer of "
                                f"32 inputs; evaluate it with the model it was trained from")
    assert "base:" not in proc.stdout and not (tmp_path / "out" / "scores.json").exists()
    from diffusers import FluxTransformer2DModel
    base = FluxTransformer2DModel.from_pretrained(os.path.join(tiny["flux"], "transformer"))
    state = {k: v.clone() for k, v in base.state_dict().items()}
    export = tmp_path / "transformer"
    export.mkdir()
    for name, change, message in [("proj_out.weight", lambda v: torch.zeros(v.shape[0] + 1, v.shape[1]),
                                   "proj_out.weight is [{}, {}], the model's [{}, {}]"),
                                  ("proj_out.bias", None, "it lacks proj_out.bias (1 tensors)")]:
        edited = dict(state)
        if change is None:
            del edited[name]
        else:
            edited[name] = change(state[name])
        save_file(edited, str(export / "diffusion_pytorch_model.safetensors"))
        shape = list(state["proj_out.weight"].shape)
        expected = message.format(shape[0] + 1, shape[1], *shape) if change else message
        with pytest.raises(SystemExit) as e:
            evaluate.check_fits({"name": "x", "path": str(export), "weights": "transformer"}, base, "m")
        assert str(e.value) == f"error: --checkpoints 'x' does not fit --model 'm': {expected}; evaluate it with the " \
                               f"model it was trained from"
    save_file(state, str(export / "diffusion_pytorch_model.safetensors"))
    evaluate.check_fits({"name": "x", "path": str(export), "weights": "transformer"}, base, "m")  # fits: no error


@pytest.mark.parametrize("field,value,message", [("reward_timeout", 0.0, "--reward-timeout 0.0 is not allowed; use a value in (0, 86400]"),
                                                 ("reward_timeout", 1e300, "--reward-timeout 1e+300 is not allowed; use a value in (0, 86400]"),
                                                 ("reward_retries", -1, "--reward-retries -1 is not allowed; use a value in [0, 100]")])
def test_the_reward_server_flags_are_checked(field, value, message):
    import dataclasses

    import evaluate
    import flow_grpo
    from helpers import check_args
    models = dataclasses.replace(flow_grpo.Args().reward_models, **{field: value})
    with pytest.raises(SystemExit) as e:
        check_args(flow_grpo, reward_models=models)
    assert str(e.value) == f"error: {message}"
    with pytest.raises(SystemExit) as e:
        evaluate.check_args(dataclasses.replace(evaluate.Args(), reward_models=models))
    assert str(e.value) == f"error: {message}"
