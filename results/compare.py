"""The algorithm files compared on the toy world at equal iterations and at equal NFE, over several seeds.

    python results/compare.py                  # run every missing (config, seed), then write results/compare/
    python results/compare.py --summary-only   # rebuild the plots and tables from results/compare/raw/
    python results/compare.py --video          # the moving-shapes world: first-frame, mean and motion rewards
    python results/compare.py --edit           # the editing toy world: every file at equal NFE

Each run is one algorithm file on `--model toy` (its TOY preset plus the flags in CONFIGS), one thread, `--workers`
runs side by side. A config runs max(--min-iterations, its share of --budget-nfe) iterations, rounded up to a multiple
of --eval-every, and is evaluated (ODE, 256 fixed held-out prompt/seed pairs) every --eval-every iterations.
Resumable: finished runs are kept in results/compare/raw/ and skipped; an interrupted run continues from its latest
checkpoint under --runs-dir (one stopped after its last iteration is only collected). The summary needs only raw/,
so it can be rebuilt anywhere. One comparison at a time holds --runs-dir (a second stops in one line); the files it
keeps there are replaced whole, and one that a kill left unreadable makes its run start over.
"""
import argparse
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stats as st  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = 2  # bumped whenever a change alters what the toy runs compute (2: after the fidelity fixes)
A, B, S = "toy_color_position", "toy_shape_count", "toy_strict"
PSI = "results/toy_psi.json"  # runs start in the repository root
# name: (script, flags on top of its TOY preset, seeds); 10 seeds for the rows of the claims that 5 left unresolved
CONFIGS = {
    "flow_grpo": ("flow_grpo.py", [], 10),
    "flow_grpo_coca": ("flow_grpo.py", ["--credit", "coca"], 10),
    "dancegrpo": ("dancegrpo.py", [], 10),
    "mixgrpo": ("mixgrpo.py", [], 5),
    "mixgrpo_flash": ("mixgrpo.py", ["--flash"], 5),
    "g2rpo_L1": ("g2rpo.py", ["--lambdas", "1"], 5),
    "g2rpo_L12": ("g2rpo.py", ["--lambdas", "1", "2"], 5),
    "g2rpo_L13": ("g2rpo.py", ["--lambdas", "1", "3"], 5),
    "g2rpo_L123": ("g2rpo.py", ["--lambdas", "1", "2", "3"], 10),
    "g2rpo_L123_1step": ("g2rpo.py", ["--lambdas", "1", "2", "3", "--updates-per-iteration", "1", "--learning-rate",
                                      "1e-4"], 3),
    "dense_uniform": ("densegrpo.py", ["--prompts-per-iteration", "4"], 10),
    "dense_calibrated": ("densegrpo.py", ["--prompts-per-iteration", "4", "--psi", PSI], 10),
    "dense_baseline": ("densegrpo.py", ["--prompts-per-iteration", "4", "--psi", PSI, "--dense-baseline"], 5),
    "dense_n1": ("densegrpo.py", ["--prompts-per-iteration", "4", "--psi", PSI, "--dense-ode-steps", "1"], 3),
    "dense_n2": ("densegrpo.py", ["--prompts-per-iteration", "4", "--psi", PSI, "--dense-ode-steps", "2"], 3),
    "flow_grpo_exact_kl": ("flow_grpo.py", ["--kl-form", "exact"], 3),
    "flow_grpo_colour_only": ("flow_grpo.py", ["--rewards", A, "--eval-rewards", B, S], 3),
    "flow_grpo_shape_only": ("flow_grpo.py", ["--rewards", B, "--eval-rewards", A, S], 3),
    "diffusion_nft": ("diffusion_nft.py", [], 0),  # run in the equal-compute comparison only (EQUAL)
    "awm": ("awm.py", [], 0),
    "dgpo": ("dgpo.py", [], 0),
    "flow_dppo": ("flow_dppo.py", [], 0),
    "dpo": ("dpo.py", [], 0),
    "crd": ("crd.py", [], 0),
    "flow_grpo_guard": ("flow_grpo.py", ["--guard", "--beta", "0", "--clip-range", "2e-6"], 0),  # docs/flow_grpo.md
}
# The equal-compute comparison (--equal; results/compare/equal/): every file's preset, each run to at least the NFE
# of 60 Flow-GRPO iterations, so that the cheaper methods are not cut off before they plateau. {config: seeds}: 10
# for the rows of the efficiency claims (DiffusionNFT, AWM and MixGRPO-Flash against their baselines), else 5.
EQUAL = {"flow_grpo": 10, "flow_grpo_coca": 5, "dancegrpo": 5, "mixgrpo": 10, "mixgrpo_flash": 10, "g2rpo_L123": 5,
         "dense_calibrated": 5, "diffusion_nft": 10, "awm": 10, "dgpo": 10, "flow_dppo": 10, "flow_grpo_guard": 5,
         "dpo": 5, "crd": 10}
EQUAL_SETTINGS = {"budget_nfe": 60 * 3072, "eval_every": 10, "out": os.path.join(ROOT, "results", "compare", "equal"),
                  "runs_dir": os.path.join(ROOT, "runs", "compare_equal")}
# The moving-shapes comparison (--video; results/compare/video/): the video toy (--model toy-video, 9 frames) trained
# on the first frame's reward, the mean over the frames and the motion reward (toy/video_world.py), every run scored
# by all of them; each run to the same NFE. {config: seeds}
VIDEO_REWARDS = {"first": ["--rewards", "toy_frame", "--frame-reduce", "first"],
                 "mean": ["--rewards", "toy_frame", "--frame-reduce", "mean"], "motion": ["--rewards", "toy_motion"]}
VIDEO_METRICS = ("toy_frame_first", "toy_frame_mean", "toy_motion", "toy_consistency", "toy_video_strict")
VIDEO_FILES = {"flow_grpo": "Flow-GRPO", "densegrpo": "DenseGRPO", "diffusion_nft": "DiffusionNFT", "awm": "AWM",
               "dgpo": "DGPO", "flow_dppo": "Flow-DPPO", "dancegrpo": "DanceGRPO", "g2rpo": "G2RPO",
               "mixgrpo": "MixGRPO", "dpo": "Online Diffusion-DPO", "crd": "CRD"}
# Flow-GRPO's and DanceGRPO's TOY presets learn motion slowly in this world (Flow-GRPO's: +2.0 paired SE after 10
# iterations; 3 seeds of 10 iterations resolved nothing, docs/video.md): they run at lr 3e-4 with two optimizer
# steps an iteration here, as in tests/test_learning.py
VIDEO_FAST = {"flow_grpo": ["--learning-rate", "3e-4", "--updates-per-iteration", "2"],
              "dancegrpo": ["--learning-rate", "3e-4", "--updates-per-iteration", "2"]}
CONFIGS.update({f"video_{f}_{r}": (f"{f}.py", ["--model", "toy-video", *VIDEO_FAST.get(f, []), *flags,
                                               "--eval-rewards", *VIDEO_METRICS], 0)
                for f in VIDEO_FILES for r, flags in VIDEO_REWARDS.items()})
VIDEO = {f"video_flow_grpo_{r}": 5 for r in VIDEO_REWARDS}  # the rows run; every file's are configured
VIDEO_SETTINGS = {"budget_nfe": 20 * 3072, "eval_every": 5, "min_iterations": 10,
                  "out": os.path.join(ROOT, "results", "compare", "video"),
                  "runs_dir": os.path.join(ROOT, "runs", "compare_video")}
# The editing comparison (--edit; results/compare/edit/): every file's TOY preset on the editing toy (--model
# toy-edit: rundir.TOY_EDIT_WORLD, trained on toy_edit + toy_preserve), each run to the same NFE. {config: seeds}
EDIT_METRICS = ("toy_edit", "toy_preserve", "toy_edit_strict")
CONFIGS.update({f"edit_{f}": (f"{f}.py", ["--model", "toy-edit"], 0) for f in VIDEO_FILES})
EDIT = {f"edit_{f}": 5 for f in VIDEO_FILES}
EDIT_SETTINGS = {"budget_nfe": 10 * 3072, "eval_every": 5, "min_iterations": 5, "eval_num": 128,
                 "out": os.path.join(ROOT, "results", "compare", "edit"),
                 "runs_dir": os.path.join(ROOT, "runs", "compare_edit")}
# The papers' main tables, each row a config: name: (title, {config: the paper's row name}, claims); a claim is
# (what the paper finds, config a, config b, kind): "better" = a above b; "comparable" = a within a margin of b.
TABLES = {
    "g2rpo_table1": ("G2RPO Table 1 on the toy", {
        "dancegrpo": "DanceGRPO", "mixgrpo": "MixGRPO", "g2rpo_L1": "G2RPO w/o MGAI (Lambda {1})",
        "g2rpo_L12": "G2RPO, Lambda {1, 2}", "g2rpo_L13": "G2RPO, Lambda {1, 3}", "g2rpo_L123": "G2RPO, Lambda {1, 2, 3}"}, [
        ("G2RPO beats DanceGRPO", "g2rpo_L123", "dancegrpo", "better"),
        ("G2RPO beats MixGRPO", "g2rpo_L123", "mixgrpo", "better"),
        ("Singular Stochastic Sampling alone (w/o MGAI) beats DanceGRPO", "g2rpo_L1", "dancegrpo", "better"),
        ("MixGRPO beats DanceGRPO", "mixgrpo", "dancegrpo", "better"),
        ("MGAI helps: Lambda {1, 2, 3} beats {1}", "g2rpo_L123", "g2rpo_L1", "better"),
        ("Lambda {1, 2} beats {1}", "g2rpo_L12", "g2rpo_L1", "better"),
        ("Lambda {1, 3} beats {1}", "g2rpo_L13", "g2rpo_L1", "better")]),
    "densegrpo_table1": ("DenseGRPO Table 1 on the toy", {
        "flow_grpo": "Flow-GRPO", "flow_grpo_coca": "Flow-GRPO + CoCA", "dense_baseline": "Dense reward (baseline)",
        "dense_uniform": "DenseGRPO, uniform psi = 0.5", "dense_calibrated": "DenseGRPO (calibrated psi(t))"}, [
        ("DenseGRPO beats Flow-GRPO", "dense_calibrated", "flow_grpo", "better"),
        ("DenseGRPO beats Flow-GRPO + CoCA", "dense_calibrated", "flow_grpo_coca", "better"),
        ("CoCA beats Flow-GRPO", "flow_grpo_coca", "flow_grpo", "better"),
        ("The step reward Delta R beats the dense reward baseline R_{t-1}", "dense_calibrated", "dense_baseline",
         "better"),
        ("The calibrated psi(t) beats a uniform psi", "dense_calibrated", "dense_uniform", "better"),
        ("A uniform psi still beats Flow-GRPO", "dense_uniform", "flow_grpo", "better")]),
    "mixgrpo_flash": ("MixGRPO-Flash's efficiency claim on the toy", {
        "mixgrpo": "MixGRPO", "mixgrpo_flash": "MixGRPO-Flash"}, [
        ("MixGRPO-Flash reaches a reward comparable to MixGRPO's", "mixgrpo_flash", "mixgrpo", "comparable")]),
}
QUESTIONS = [  # the other questions of this comparison, judged like the tables' claims
    ("DenseGRPO: n = 2 beats n = t", "dense_n2", "dense_calibrated", "better"),
    ("DenseGRPO: Flow-GRPO beats n = 1 (the paper: n = 1 is worse than Flow-GRPO)", "flow_grpo", "dense_n1", "better"),
    ("Flow-GRPO: the official KL scale beats the exact Gaussian KL", "flow_grpo", "flow_grpo_exact_kl", "better"),
    ("G2RPO: one step per trained k (lr 1.25e-5) is comparable to one per iteration (lr 1e-4)", "g2rpo_L123",
     "g2rpo_L123_1step", "comparable"),
    ("G2RPO w/o MGAI beats Flow-GRPO", "g2rpo_L1", "flow_grpo", "better"),
    ("DanceGRPO is comparable to Flow-GRPO", "dancegrpo", "flow_grpo", "comparable"),
    ("Joint training beats colour/position-only training", "flow_grpo", "flow_grpo_colour_only", "better"),
    ("Shape/count-only training beats joint training", "flow_grpo_shape_only", "flow_grpo", "better"),
]
MARGIN = 0.25  # "comparable": the 2-SE interval of the difference within +- this fraction of b's gain
FIRST_SEEDS = 5  # a claim whose rows have more seeds is also judged on the first 5 (what the longer budget changed)
FIGURES = {  # file: (question, configs)
    **{name: (title, list(rows)) for name, (title, rows, _) in TABLES.items()},
    "g2rpo_lambdas": ("G2RPO: does multi-granularity (Lambda) help, and at what cost?",
                      ["g2rpo_L1", "g2rpo_L12", "g2rpo_L13", "g2rpo_L123"]),
    "dense_psi_n": ("DenseGRPO: calibrated vs uniform psi, and ODE completion length n",
                    ["dense_uniform", "dense_calibrated", "dense_n1", "dense_n2"]),
    "fidelity_choices": ("KL scale and optimizer steps: Flow-GRPO official vs exact KL, G2RPO per-k vs one step",
                         ["flow_grpo", "flow_grpo_exact_kl", "g2rpo_L123", "g2rpo_L123_1step"]),
    "reward_hacking": ("Single-reward training: do the other reward and the strict metric fall?",
                       ["flow_grpo", "flow_grpo_colour_only", "flow_grpo_shape_only"]),
}


def planned_per_iteration(config: str) -> float:
    """All transformer forwards of one iteration of a config at iteration 0 (rollout, training, reference), from
    its file's own planned_nfe on its TOY preset plus the config's flags."""
    import dataclasses
    import importlib

    import tyro

    script, flags = CONFIGS[config][:2]
    sys.path[:0] = [ROOT, os.path.join(ROOT, "toy")]
    module = importlib.import_module(script[:-3])
    args = tyro.cli(module.Args, args=flags, default=dataclasses.replace(module.Args(), **module.TOY))
    per_prompt = module.planned_nfe(args)
    return args.prompts_per_iteration * sum(per_prompt.values())


def seeds_of(a, config):
    """The seeds a config runs: --seeds if given, else 0 .. (its count in CONFIGS, or EQUAL with --equal, VIDEO
    with --video) - 1."""
    if a.seeds:
        return a.seeds
    if getattr(a, "video", False) or getattr(a, "edit", False):
        return list(range((VIDEO if getattr(a, "video", False) else EDIT).get(config, 0)))
    return list(range(EQUAL[config] if getattr(a, "equal", False) else CONFIGS[config][2]))


def plan(a):
    """{config: iterations}: max(min_iterations, budget / NFE per iteration), rounded up to a multiple of eval_every."""
    if a.iterations:
        return {c: a.iterations for c in a.configs}
    e = a.eval_every
    return {c: max(a.min_iterations, e * math.ceil(a.budget_nfe / planned_per_iteration(c) / e)) for c in a.configs}


def raw_path(a, config, seed):
    return os.path.join(a.out, "raw", f"{config}__seed{seed}.json")


def settings(a, config, iterations):
    """Everything a finished or interrupted run depends on; a rerun must match it to reuse the run."""
    return {"iterations": iterations, "eval_every": a.eval_every, "eval_num": a.eval_num, "extra": a.extra,
            "flags": CONFIGS[config][1], "version": VERSION}


def rundir():
    """The project's rundir module (its bounded readers, atomic writes and locks)."""
    if ROOT not in sys.path:
        sys.path[:0] = [ROOT]
    import rundir
    return rundir


def read_json(path, *, limit=1 << 28):
    """A JSON file of a comparison within bounds (rundir.read_json), or one line naming it."""
    try:
        return rundir().read_json(path, limit=limit)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {path} cannot be read ({type(e).__name__}); delete it to do that run again")


def run_record(out_dir):
    """<out_dir>.json, what loop() records of a run (its settings, the machines that trained it), or None; one that
    cannot be read (an older compare.py wrote it in place, and a kill left it empty) takes the run with it: both are
    removed, and the run starts over."""
    path = out_dir + ".json"
    if not os.path.exists(path):
        return None
    try:
        record = rundir().read_json(path)
        if isinstance(record, dict) and isinstance(record.get("machines", []), list):
            return record
    except (OSError, ValueError):
        pass
    print(f"{path} cannot be read (a kill while it was written?): {out_dir} starts over", flush=True)
    os.remove(path)
    shutil.rmtree(out_dir, ignore_errors=True)
    return None


def check_settings(path, want, found):
    """A raw file's or a run record's settings (`found`: its content, None if there is none) must be `want`."""
    have = found.get("settings") if isinstance(found, dict) else found
    if found is not None and have != want:
        sys.exit(f"error: {path} was made with {have}, not {want}; pass another --out / --runs-dir or delete it")


def machine() -> dict:
    """The machine a run (or the part of it since a resume) trains on: its boot id and CPU model. CPU time is only
    comparable within one machine: the same run took 1.6x the CPU seconds per iteration on another."""
    try:
        ident = open("/proc/sys/kernel/random/boot_id").read().strip()
        cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "")
    except OSError:
        import platform
        ident, cpu = platform.node(), platform.processor()
    return {"id": ident, "cpu": cpu}


def resumed_iteration(cmd) -> int:
    """The iteration a command resumes after (the checkpoint its --resume picks, by the files' own rule), 0 for a
    fresh start."""
    if "--resume" not in cmd:
        return 0
    sys.path[:0] = [ROOT]
    from rundir import iteration_of, latest_checkpoint
    return iteration_of(latest_checkpoint(cmd[cmd.index("--resume") + 1]))


def command(a, config, seed, iterations, out_dir):
    script, flags = CONFIGS[config][:2]
    cmd = [sys.executable, os.path.join(ROOT, script), "--model", "toy", "--seed", str(seed), "--output-dir", out_dir,
           "--exp-name", config, "--num-iterations", str(iterations), "--eval-every", str(a.eval_every), "--eval-num",
           str(a.eval_num), "--save-every", str(a.eval_every), "--log-images-every", "0", *flags, *a.extra.split()]
    runs = [os.path.join(out_dir, d) for d in os.listdir(out_dir)] if os.path.isdir(out_dir) else []
    resumable = [r for r in runs if os.path.isdir(os.path.join(r, "checkpoints"))
                 and any(not d.endswith(".tmp") for d in os.listdir(os.path.join(r, "checkpoints")))]
    newest = max(resumable, key=lambda r: (resumed_iteration(["--resume", r]), r)) if resumable else None
    for r in runs:  # runs that never reached a checkpoint start over; of two (left by two comparisons at once,
        if r != newest:  # before the lock), the one with the newest checkpoint goes on
            print(f"removing {r}: " + ("a second run of this seed" if r in resumable else "no checkpoint"), flush=True)
            shutil.rmtree(r) if os.path.isdir(r) else os.remove(r)
    return cmd + (["--resume", newest] if newest else [])


def recorded_machines(out_dir) -> list:
    """The machines that trained a run's iterations so far, as loop() records them ([] for a run begun elsewhere)."""
    return (run_record(out_dir) or {}).get("machines", [])


def collect(a, config, seed, iterations, out_dir):
    """Copy a finished run's logs into raw/ (per-iteration metrics, every evaluation's per-pair scores)."""
    (run,) = [os.path.join(out_dir, d) for d in os.listdir(out_dir)]
    rows = {}
    for r in rundir().read_jsonl(os.path.join(run, "metrics.jsonl")):  # bounded, each row checked
        rows.setdefault(r["iteration"], {}).update(r)  # a resumed run re-logs iterations after its checkpoint
    evals = {}
    for name in os.listdir(run):
        if name.startswith("eval_") and name.endswith(".json"):
            evals[int(name[5:-5])] = {k: [round(x, 5) for x in v] for k, v in read_json(os.path.join(run, name)).items()}
    os.makedirs(os.path.dirname(raw_path(a, config, seed)), exist_ok=True)
    tmp = raw_path(a, config, seed) + ".tmp"
    machines = recorded_machines(out_dir)
    more = a.measure(run) if getattr(a, "measure", None) else {}  # e.g. results/hacking.py's KL, from checkpoints
    with open(tmp, "w") as f:
        json.dump({"config": config, "seed": seed, "script": CONFIGS[config][0], "settings": settings(a, config, iterations),
                   "machines": machines, "metrics": [rows[i] for i in sorted(rows) if i <= iterations],
                   "evals": {str(i): evals[i] for i in sorted(evals) if i <= iterations}, **more}, f)
    os.replace(tmp, raw_path(a, config, seed))
    shutil.rmtree(os.path.join(run, "checkpoints"), ignore_errors=True)


def run_all(a):
    iters = plan(a)
    os.makedirs(a.runs_dir, exist_ok=True)
    taken = rundir().hold_run_directory(a.runs_dir, what="--runs-dir", why="two comparisons in one --runs-dir would "
                                        "start the same runs twice")  # held until this process ends
    if taken:
        sys.exit(f"error: {taken}")
    for c in a.configs:
        for s in seeds_of(a, c):
            raw, out_dir = raw_path(a, c, s), os.path.join(a.runs_dir, c, f"seed{s}")
            check_settings(raw, settings(a, c, iters[c]), read_json(raw) if os.path.exists(raw) else None)
            check_settings(out_dir + ".json", settings(a, c, iters[c]), run_record(out_dir))
    todo = [(c, s) for s in range(max(max(seeds_of(a, c), default=-1) for c in a.configs) + 1)
            for c in sorted(a.configs, key=lambda c: -iters[c] * planned_per_iteration(c))
            if s in seeds_of(a, c) and not os.path.exists(raw_path(a, c, s))]
    print(f"{len(todo)} runs to do, {a.workers} at a time; iterations per config: {iters}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false")
    running, failed, t0 = {}, [], time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("interrupted; run the same command again to resume"))
    try:
        loop(a, iters, todo=todo, running=running, failed=failed, env=env, t0=t0)
    finally:  # never leave runs behind: a rerun resumes them from their checkpoints
        for p, _, log in running.values():
            p.terminate()
        for p, _, log in running.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()
    if failed:
        sys.exit("error: runs failed: " + "; ".join(failed))


def unblock_sigterm():
    """In a child, before it runs: the mask it inherits blocks SIGTERM (see loop), and terminate() must reach it."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])


def loop(a, iters, *, todo, running, failed, env, t0):
    while todo or running:
        while todo and len(running) < a.workers:
            c, s = todo.pop(0)
            out_dir = os.path.join(a.runs_dir, c, f"seed{s}")
            cmd = command(a, c, s, iters[c], out_dir)
            os.makedirs(out_dir, exist_ok=True)
            start = resumed_iteration(cmd)
            if start >= iters[c]:  # trained to the end, then stopped before its collection: only collect it
                print(f"[{time.time() - t0:6.0f} s] collect {c} seed {s} (trained to iteration {start})", flush=True)
                collect(a, c, s, iters[c], out_dir)
                print(f"[{time.time() - t0:6.0f} s] done {c} seed {s}", flush=True)
                continue
            machines = [m for m in recorded_machines(out_dir) if m["from_iteration"] < start]
            machines.append({"from_iteration": start, **machine()})
            rundir().write_atomically(out_dir + ".json", json.dumps({"settings": settings(a, c, iters[c]),  # a kill
                                                                     "machines": machines}))  # leaves it whole
            log = open(out_dir + ".log", "a")
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # a child is always registered before a stop
            running[(c, s)] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                preexec_fn=unblock_sigterm), out_dir, log)  # the child can be stopped
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
            print(f"[{time.time() - t0:6.0f} s] start {c} seed {s}" + (" (resumed)" if "--resume" in cmd else ""), flush=True)
        time.sleep(0.5)
        for (c, s), (p, out_dir, log) in list(running.items()):
            if p.poll() is None:
                continue
            log.close()
            del running[(c, s)]
            if p.returncode == 0:
                collect(a, c, s, iters[c], out_dir)
            else:
                failed.append(f"{c} seed {s} (exit {p.returncode}; see {log.name})")
            print(f"[{time.time() - t0:6.0f} s] {'done' if p.returncode == 0 else 'FAILED'} {c} seed {s}", flush=True)


# ---------------------------------------------------------------- summary
def load(a):
    runs = {}
    for c in a.configs:
        for s in seeds_of(a, c):
            if os.path.exists(raw_path(a, c, s)):
                runs.setdefault(c, []).append(read_json(raw_path(a, c, s)))
    return runs


def machine_of(run, iteration) -> str:
    """The machine that trained an iteration of a run; runs collected before machines were recorded (every one of
    them on machines of one speed: a config's seeds there are within 25% in CPU seconds per iteration, where the
    first recorded machine took 1.6x less) count as one machine, "unrecorded"."""
    segments = [{"from_iteration": 0, "id": "unrecorded"}, *run.get("machines", [])]
    return [m["id"] for m in segments if m["from_iteration"] < max(iteration, 1)][-1]


def cpu_units(flow_grpo_runs) -> dict:
    """{machine: Flow-GRPO's mean training CPU seconds per iteration on it}, the unit of the equal-compute
    comparison's CPU time: each run's CPU time counts in Flow-GRPO iterations of the machine that spent it."""
    per = {}
    for run in flow_grpo_runs:
        for r in run["metrics"]:
            if r.get("perf/cpu_seconds_per_iteration"):
                per.setdefault(machine_of(run, r["iteration"]), []).append(r["perf/cpu_seconds_per_iteration"])
    return {m: sum(v) / len(v) for m, v in per.items()}


def cpu_of(run, row, units) -> float:
    """A metrics row's training CPU time: seconds, or in Flow-GRPO iterations on its machine (`units`)."""
    seconds = row.get("perf/cpu_seconds_per_iteration", 0)  # logged since the equal-compute comparison
    if units is None or not seconds:
        return seconds
    m = machine_of(run, row["iteration"])
    if m not in units:
        sys.exit(f"error: {run['config']} seed {run['seed']} trained on machine {m}, where no flow_grpo run measured "
                 "the CPU unit; run a new flow_grpo seed there (python results/compare.py --equal --configs flow_grpo "
                 "--seeds N --iterations 10, N a seed not in raw/)")
    return seconds / units[m]


def curves(run, units=None):
    """Per evaluation: iteration, cumulative NFE, cumulative seconds, cumulative CPU time (cpu_of), the mean of every
    metric (train = mean of the two training rewards, whatever the run trained on) and, under "pairs", every
    metric's score on each evaluation pair."""
    nfe, sec, cpu, cum = 0.0, 0.0, 0.0, {0: (0.0, 0.0, 0.0)}
    for r in run["metrics"]:
        nfe, sec = nfe + r.get("perf/nfe_per_iteration", 0), sec + r.get("perf/seconds_per_iteration", 0)
        cpu += cpu_of(run, r, units)
        cum[r["iteration"]] = (nfe, sec, cpu)
    out = []
    for i, e in sorted(((int(k), v) for k, v in run["evals"].items())):
        pairs = {k: np.asarray(v, dtype=np.float64) for k, v in e.items()}
        if A in pairs and B in pairs:  # the image world's (the video world's runs train one reward)
            pairs["train"] = (pairs[A] + pairs[B]) / 2
        m = {k: float(v.mean()) for k, v in pairs.items()}
        out.append({"iteration": i, "nfe": cum[i][0], "seconds": cum[i][1], "cpu": cum[i][2], **m, "pairs": pairs})
    return out


def at(curve, key, value, metric):
    """metric at curve[key] == value, linear between the two evaluations around it (None if out of range); metric
    "pairs/<name>": every pair's score."""
    get = (lambda p: p["pairs"][metric[6:]]) if metric.startswith("pairs/") else (lambda p: p[metric])  # noqa: E731
    for p, q in zip(curve, curve[1:]):
        if p[key] <= value <= q[key]:
            w = (value - p[key]) / (q[key] - p[key]) if q[key] > p[key] else 1.0
            return get(p) + w * (get(q) - get(p))
    return None


def stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return float("nan"), float("nan"), 0
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan")
    return m, sd, len(xs)


def closed_form(run):
    """Closed-form minimum rollout NFE per prompt: logged by G2RPO and DenseGRPO; G T for Flow-GRPO."""
    rows = [r for r in run["metrics"] if "perf/nfe_min_per_prompt" in r]
    if rows:
        return rows[0]["perf/nfe_min_per_prompt"]
    tokens = run["settings"]["flags"] + run["settings"]["extra"].split()
    value = lambda flag, default: int(tokens[len(tokens) - 1 - tokens[::-1].index(flag) + 1]) if flag in tokens else default  # noqa: E731
    return value("--group-size", 12) * value("--num-steps", 16)  # the TOY preset's G and T unless overridden


def pair_gains(xs, key, value, metric) -> np.ndarray:
    """[runs, pairs]: each run's change of every pair from its iteration 0 at curve[key] == value (linear between
    evaluations; key None: its last evaluation); runs that end before it are left out."""
    rows = [(x[-1]["pairs"][metric] if key is None else at(x, key, value, "pairs/" + metric), x[0]["pairs"][metric])
            for x in xs]
    return np.array([v - base for v, base in rows if v is not None])


def mean_change(xs, key, value, metric, *, config):
    """(the mean change over seeds and pairs, its resamples (results/stats.py), the number of seeds)."""
    d = pair_gains(xs, key, value, metric)
    if len(d) == 0:
        return float("nan"), np.full(st.RESAMPLES, np.nan), 0
    return float(d.mean()), st.over_seeds(st.on_pairs(d), config), len(d)


def change(xs, key, value, metric, *, config, absolute=False):
    """'+0.0123 [+0.0045, +0.0201]': the change from the base model (absolute: the mean itself), mean over seeds and
    pairs, and its interval (results/stats.py; with one seed: no interval)."""
    if absolute:
        rows = [x[-1]["pairs"][metric] if key is None else at(x, key, value, "pairs/" + metric) for x in xs]
        d = np.array([v for v in rows if v is not None])
        m, draws, n = float(d.mean()), st.over_seeds(st.on_pairs(d), config), len(d)
    else:
        m, draws, n = mean_change(xs, key, value, metric, config=config)
    if n < 2:
        return f"{m:{'' if absolute else '+'}.4f}"
    return st.fmt(m, *st.interval(draws, seeds=n), sign="" if absolute else "+")


def difference(cv, a, b, key, value, metric):
    """(mean change of a - mean change of b, the interval of the difference (NaN with one seed a side), b's mean
    change): the same pairs' resample for both, each config's own seeds' resample."""
    (ma, da, na), (mb, db, nb) = (mean_change(cv[c], key, value, metric, config=c) for c in (a, b))
    if min(na, nb) < 2:
        return ma - mb, float("nan"), float("nan"), mb
    return (ma - mb, *st.interval(da - db, seeds=min(na, nb)), mb)


def overall(verdicts, kind):
    """One verdict from the training reward's and the strict metric's: better needs one supported and none not
    supported; comparable needs both supported (one not supported is enough against)."""
    if kind == "comparable":
        return ("supported" if set(verdicts) == {"supported"} else
                "not supported" if "not supported" in verdicts else "unresolved")
    if "supported" in verdicts and "not supported" not in verdicts:
        return "supported"
    return "not supported" if "not supported" in verdicts and "supported" not in verdicts else "unresolved"


def claim_rows(cv, claims, keys=("iteration", "nfe")):
    """One row per claim (and one on the first FIRST_SEEDS seeds where a row has more): the difference of the
    changes at equal iterations and at equal NFE (or `keys`: the last point both configs reach), with its interval
    and the verdicts (results/stats.py)."""
    names = {"iteration": "iterations", "nfe": "NFE", "cpu": "CPU (Flow-GRPO iterations)"}
    lines = [f"| claim (a vs b) | seeds (a, b) | {names[keys[0]]} | training reward | strict | verdict | "
             f"{names[keys[1]]} | training reward | strict | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for text, a, b, kind in claims:
        if a not in cv or b not in cv:
            continue
        subsets = [(cv, "")]
        if max(len(cv[a]), len(cv[b])) > FIRST_SEEDS:
            subsets.append(({a: cv[a][:FIRST_SEEDS], b: cv[b][:FIRST_SEEDS]}, f", first {FIRST_SEEDS} seeds"))
        for sub, note in subsets:
            cells = [f"{text}{note} ({a} vs {b})", f"{len(sub[a])}, {len(sub[b])}"]
            for key in keys:
                value = min(x[-1][key] for x in sub[a] + sub[b])
                verdicts = []
                cells.append(f"{value:,.1f}" if key == "cpu" else f"{value:,.0f}")
                for metric in ("train", S):
                    d, lo, hi, ref = difference(sub, a, b, key, value, metric)
                    margin = MARGIN * abs(ref)
                    verdicts.append(st.verdict(lo, hi, kind=kind, margin=margin))
                    cell_text = st.fmt(d, lo, hi) if math.isfinite(lo) else f"{d:+.4f} (one seed: no interval)"
                    cells.append(cell_text + (f" (margin {margin:.4f})" if kind == "comparable" else ""))
                cells.append(f"**{overall(verdicts, kind)}**")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def paper_table(cv, runs, title, rows, claims):
    """A paper's table on the toy: each row's change from the base model with its interval at the table's equal
    iterations and equal NFE (the last point every row reaches), then its claims."""
    rows = {c: name for c, name in rows.items() if c in cv}
    if not rows:
        return []
    eq_iter = min(x[-1]["iteration"] for c in rows for x in cv[c])
    eq_nfe = min(x[-1]["nfe"] for c in rows for x in cv[c])
    lines = [f"### {title}", "", f"| method | config | seeds | iterations | NFE per iteration | training reward, "
             f"{eq_iter} iterations | strict, {eq_iter} iterations | training reward, {eq_nfe:,.0f} NFE | strict, "
             f"{eq_nfe:,.0f} NFE |", "|---|---|---|---|---|---|---|---|---|"]
    for c, name in rows.items():
        nfe = stats([r["perf/nfe_per_iteration"] for run in runs[c] for r in run["metrics"] if "perf/nfe_per_iteration" in r])
        cells = [change(cv[c], key, value, m, config=c) for key, value in (("iteration", eq_iter), ("nfe", eq_nfe))
                 for m in ("train", S)]
        lines.append(f"| {name} | {c} | {len(cv[c])} | {cv[c][0][-1]['iteration']} | {nfe[0]:,.0f} | "
                     + " | ".join(cells) + " |")
    return lines + ["", *claim_rows(cv, claims), ""]


# ---------------------------------------------------------------- the equal-compute comparison (--equal)
EQUAL_ROWS = {"flow_grpo": "Flow-GRPO", "flow_grpo_coca": "Flow-GRPO + CoCA", "dancegrpo": "DanceGRPO",
              "mixgrpo": "MixGRPO", "mixgrpo_flash": "MixGRPO-Flash", "g2rpo_L123": "G2RPO, Lambda {1, 2, 3}",
              "dense_calibrated": "DenseGRPO", "diffusion_nft": "DiffusionNFT", "awm": "AWM", "dgpo": "DGPO",
              "flow_dppo": "Flow-DPPO", "flow_grpo_guard": "Flow-GRPO + GRPO-Guard", "dpo": "Online Diffusion-DPO",
              "crd": "CRD"}
EFFICIENCY = [  # the papers' efficiency claims: (what the paper finds, a, b, kind), judged at equal NFE and CPU time
    ("DiffusionNFT beats Flow-GRPO (its paper: 3x-25x faster)", "diffusion_nft", "flow_grpo", "better"),
    ("AWM beats Flow-GRPO (its paper: up to 24x faster)", "awm", "flow_grpo", "better"),
    ("MixGRPO-Flash beats MixGRPO (its paper: less time for a comparable reward)", "mixgrpo_flash", "mixgrpo",
     "better"),
    ("DGPO beats Flow-GRPO (its paper: ~20x faster)", "dgpo", "flow_grpo", "better"),
    ("DGPO beats AWM", "dgpo", "awm", "better"),
    ("DGPO beats DiffusionNFT", "dgpo", "diffusion_nft", "better"),
    ("Flow-DPPO beats Flow-GRPO", "flow_dppo", "flow_grpo", "better"),
    ("CRD beats DiffusionNFT (its paper: fast convergence)", "crd", "diffusion_nft", "better")]
EQUAL_QUESTIONS = [  # judged as EFFICIENCY's, on the rows' own seeds (5 for DPO and CRD)
    ("Flow-GRPO beats online Diffusion-DPO (Flow-GRPO's paper: its baseline)", "flow_grpo", "dpo", "better"),
    ("CRD beats Flow-GRPO (asked after its runs)", "crd", "flow_grpo", "better")]


def resampled_curve(runs, key, metric, *, config, absolute=False):
    """The mean curve over seeds [(x, change)] per evaluation that every run has (absolute: the metric itself), and
    its resamples (results/stats.py): (x [E], y [E], X [RESAMPLES, E], Y [RESAMPLES, E])."""
    e = min(map(len, runs))
    xv = np.array([[p[key] for p in x[:e]] for x in runs])
    g = np.stack([[p["pairs"][metric] - (0 if absolute else x[0]["pairs"][metric]) for p in x[:e]] for x in runs])
    draws = st.seed_draws(config, len(runs))
    return xv.mean(0), g.mean((0, 2)), xv[draws].mean(1), st.over_seeds(np.moveaxis(st.on_pairs(g), 2, 1), config)


def value_at(X, Y, x):
    """[R]: each mean curve (X[r], Y[r]) at x, linear between evaluations (NaN outside it, beyond a rounding error
    of a mean of equal values)."""
    out, xr = np.full(len(X), np.nan), np.clip(x, X[:, 0], X[:, -1])
    xr = np.where(np.abs(xr - x) <= 1e-9 * max(abs(x), 1.0), xr, np.nan)
    for e in range(1, X.shape[1]):
        inside = np.isnan(out) & (X[:, e - 1] <= xr) & (xr <= X[:, e])
        w = (xr[inside] - X[inside, e - 1]) / np.maximum(X[inside, e] - X[inside, e - 1], 1e-300)
        out[inside] = Y[inside, e - 1] + w * (Y[inside, e] - Y[inside, e - 1])
    return out


def first_reach(X, Y, target, *, slack: float = 1e-12):
    """[R]: the first x at which each mean curve (X[r], Y[r]) reaches target[r] (a number: every curve's),
    linear between evaluations (NaN where it never does; `slack` for a target read off the curve itself)."""
    out = np.full(len(X), np.nan)
    target = np.broadcast_to(np.asarray(target, dtype=np.float64) - slack, (len(X),))
    for e in range(X.shape[1]):
        hit = np.isnan(out) & (Y[:, e] >= target)
        if e == 0:
            out[hit] = X[hit, 0]
            continue
        y0, y1, x0, x1 = Y[hit, e - 1], Y[hit, e], X[hit, e - 1], X[hit, e]
        out[hit] = x0 + (x1 - x0) * np.clip((target[hit] - y0) / np.maximum(y1 - y0, 1e-300), 0, 1)
    return out


def target_gain(runs, x, *, config):
    """A config's change of the training reward at NFE x on its mean curve: (the value, its resamples)."""
    xv, y, X, Y = resampled_curve(runs, "nfe", "train", config=config)
    return float(value_at(xv[None], y[None], x)[0]), value_at(X, Y, x)


def to_reach(runs, key, target, *, config):
    """(x at which the mean curve over seeds first reaches target = (value, resamples), None if it never does;
    each resample's least and greatest possible x: where a resample's curve never reaches its target, the least is
    its last evaluation and the greatest infinite)."""
    xv, y, X, Y = resampled_curve(runs, key, "train", config=config)
    v = first_reach(xv[None], y[None], [target[0]])[0]
    V = first_reach(X, Y, target[1])
    return (None if math.isnan(v) else float(v)), np.where(np.isnan(V), X[:, -1], V), np.where(np.isnan(V), np.inf, V)


def reach_cell(value, least, most, *, seeds, digits=0):
    lo, hi = st.interval(least, seeds=seeds, upper=most, log=True)
    bound = "not reached" if math.isinf(hi) else f"{hi:,.{digits}f}"
    return f"{'not reached' if value is None else f'{value:,.{digits}f}'} [{lo:,.{digits}f}, {bound}]"


def speedup_rows(cv, claims, eq_nfe):
    """a's speed-up on b: (b's NFE or CPU time to reach b's change at equal NFE) / (a's), with b's change, both
    times and so the ratio recomputed on every resample; a resample in which a never reaches it counts between 0
    and (b's time over a's last evaluation). Supported when the interval lies above 1, not supported when below."""
    lines = ["| claim (a vs b) | seeds (a, b) | NFE speed-up | verdict | CPU-time speed-up | verdict |",
             "|---|---|---|---|---|---|"]
    for text, a, b, _ in claims:
        if a not in cv or b not in cv:
            continue
        target = target_gain(cv[b], eq_nfe, config=b)
        cells = [f"{text.split(' (')[0]}: speed-up ({a} vs {b})", f"{len(cv[a])}, {len(cv[b])}"]
        for key in ("nfe", "cpu"):
            va, least, most = to_reach(cv[a], key, target, config=a)
            vb, tb, _ = to_reach(cv[b], key, target, config=b)  # b reaches its own change by eq_nfe
            with np.errstate(divide="ignore", invalid="ignore"):  # where b's change is <= 0, both reach it at 0
                ratio = tb / least  # where a never reaches it: b's time over a's last evaluation, the most it can be
            undefined = np.isnan(ratio)  # no speed-up to a change of 0: it counts as anything from 0 to infinity
            lo, hi = st.interval(np.where(np.isinf(most) | undefined, 0.0, ratio), seeds=min(len(cv[a]), len(cv[b])),
                                 upper=np.where(undefined, np.inf, ratio), log=True)
            point = "a never reaches it" if va is None else f"{vb / max(va, 1e-9):.2f}x"
            cells += [f"{point} [{lo:.2f}x, {hi:.2f}x]", f"**{st.verdict(lo - 1, hi - 1)}**"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def equal_compute(out):
    """The headline section of the equal-compute comparison from <out>/raw/ (empty if it has no runs), and its
    figure <out>/equal_compute.png."""
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    e = argparse.Namespace(equal=True, seeds=None, out=out)
    runs = {c: rs for c, rs in load(argparse.Namespace(**vars(e), configs=list(EQUAL))).items()}
    if not runs:
        return []
    # the CPU unit of each machine: every flow_grpo run in raw/, also the seeds past EQUAL's that a machine adding
    # rows runs for its unit alone (--configs flow_grpo --seeds 10 --iterations 10)
    extra = sorted(glob.glob(os.path.join(out, "raw", "flow_grpo__seed*.json")))
    units = cpu_units([read_json(f) for f in extra])
    cv = {c: [curves(r, units) for r in rs] for c, rs in runs.items()}
    eq_nfe = min(x[-1]["nfe"] for xs in cv.values() for x in xs)
    eq_cpu = min(x[-1]["cpu"] for xs in cv.values() for x in xs)
    base = cv.get("flow_grpo")
    target = target_gain(base, eq_nfe, config="flow_grpo") if base else None
    lines = ["## All methods at equal compute", "",
             "Every file's toy preset, each run to at least the NFE of 60 Flow-GRPO iterations, evaluated every 10 "
             "iterations on the same held-out pairs. Each row: the change from the base model (mean over seeds and "
             "pairs, [its 95% interval]: results/stats.py, which resamples the seeds and the evaluation pairs) of the "
             f"training reward and the strict metric at equal NFE ({eq_nfe:,.0f}, the last NFE every run reaches) and "
             f"at equal CPU time (that of {eq_cpu:.1f} Flow-GRPO iterations: training only, one thread, "
             "`perf/cpu_seconds_per_iteration`, counted in Flow-GRPO's mean CPU seconds per iteration on the machine "
             "that ran the iteration, so that a faster machine's runs get no credit for its speed), and the NFE and "
             "CPU time at which the mean over seeds first reaches Flow-GRPO's change at equal NFE "
             f"({target[0]:+.4f}; on every resample Flow-GRPO's own change, so that it is always reached; 'not "
             "reached' as an interval's end: the row's curve misses it in more than 2.5% of the resamples). Claims: "
             "the rules of the papers' tables below; a speed-up (b's NFE or CPU time to reach b's change at equal "
             "NFE over a's, on every resample) is supported when its interval lies above 1, not supported when it "
             "lies below 1; a resample in which a never reaches b's change counts between 0 and b's time over a's "
             "last evaluation, and one in which b's change is not above 0 anything from 0 to infinity." if target is not None
             else "(no Flow-GRPO runs yet)", "",
             f"| method | config | seeds | iterations | NFE per iteration | CPU per iteration (Flow-GRPO = 1) | "
             f"training reward, {eq_nfe:,.0f} NFE | strict, {eq_nfe:,.0f} NFE | training reward, CPU of {eq_cpu:.1f} "
             f"Flow-GRPO iterations | strict, same CPU | NFE to reach Flow-GRPO | CPU to reach Flow-GRPO (Flow-GRPO "
             "iterations) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, name in EQUAL_ROWS.items():
        if c not in cv:
            continue
        per_it = [(run, r) for run in runs[c] for r in run["metrics"] if "perf/nfe_per_iteration" in r]
        cells = [name, c, str(len(cv[c])), str(cv[c][0][-1]["iteration"]),
                 f"{stats([r['perf/nfe_per_iteration'] for _, r in per_it])[0]:,.0f}",
                 f"{stats([cpu_of(run, r, units) for run, r in per_it])[0]:.2f}"]
        cells += [change(cv[c], key, value, m, config=c) for key, value in (("nfe", eq_nfe), ("cpu", eq_cpu))
                  for m in ("train", S)]
        cells += [reach_cell(*to_reach(cv[c], key, target, config=c), seeds=len(cv[c]), digits=int(key == "cpu"))
                  if target is not None and len(cv[c]) > 1 else "-" for key in ("nfe", "cpu")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *claim_rows(cv, EFFICIENCY + EQUAL_QUESTIONS, keys=("nfe", "cpu")), ""]
    if target is not None:
        lines += [*speedup_rows(cv, EFFICIENCY + EQUAL_QUESTIONS, eq_nfe), ""]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, label in zip(axes, ("nfe", "cpu"), ("NFE (transformer forwards)",
                                                       "training CPU time (Flow-GRPO iterations, one thread)")):
        for c, name in EQUAL_ROWS.items():
            if c not in cv:
                continue
            xs, m, _, Y = resampled_curve(cv[c], key, "train", config=c)
            band = [st.interval(Y[:, k], seeds=len(cv[c])) if len(cv[c]) > 1 else (v, v) for k, v in enumerate(m)]
            ax.plot(xs[1:], m[1:], marker="o", ms=3, label=f"{name} (n = {len(cv[c])})")
            ax.fill_between(xs[1:], [b[0] for b in band[1:]], [b[1] for b in band[1:]], alpha=0.15)
        if target is not None:
            ax.axhline(target[0], color="k", ls="--", lw=0.8, label="Flow-GRPO at equal NFE")
        ax.set(xscale="log", xlabel=label, ylabel="change of the training reward (ODE eval)")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))  # 40, not 4 x 10^1
        ax.xaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if str(v)[0] in "25" else ""))
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle("All methods at equal compute: mean over seeds (band: its 95% interval, seeds and evaluation pairs "
                 "resampled: results/stats.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "equal_compute.png"), dpi=100)
    plt.close(fig)
    return lines


def finished_rows(out, prefix: str):
    """The rows of CONFIGS named `prefix`... that have finished seeds in <out>/raw/, whichever ran: ({config: each
    seed's curves}, the last NFE every run reaches, the numbers of evaluation pairs); ({}, None, []) if none."""
    runs = {}
    for c in (c for c in CONFIGS if c.startswith(prefix)):
        for path in sorted(glob.glob(os.path.join(out, "raw", f"{c}__seed*.json"))):
            runs.setdefault(c, []).append(json.load(open(path)))
    if not runs:
        return {}, None, []
    cv = {c: [curves(r) for r in rs] for c, rs in runs.items()}
    eq_nfe = min(x[-1]["nfe"] for xs in cv.values() for x in xs)
    evals = sorted({len(next(iter(ev.values()))) for rs in runs.values() for r in rs for ev in r["evals"].values()})
    return cv, eq_nfe, evals


def video_table(out):
    """The moving-shapes comparison from <out>/raw/: per row (a file trained on one reward), the change from the base
    model of every reward at equal NFE (the last NFE every run reaches), over seeds and pairs with its interval
    (results/stats.py), and whether training on a frame's reward reaches the motion reward; <out>/video.md."""
    cv, eq_nfe, evals = finished_rows(out, "video_")
    if not cv:
        return []
    lines = ["## What a per-frame reward misses: the moving-shapes world", "",
             "The video toy (`--model toy-video`: a tiny Wan2.1-architecture WanPipeline, 9 frames of 32 x 32, "
             "toy/make_video_toy.py) trained by each row's file and TOY preset (Flow-GRPO and DanceGRPO at lr 3e-4 "
             "with two optimizer steps an iteration: VIDEO_FAST) on one reward: the first frame's "
             "`toy_frame` (`--frame-reduce first`, DanceGRPO's Wan recipe), its mean over every frame (`mean`, "
             "Flow-Factory's) or `toy_motion` (direction and speed, from every frame's centroid), and scored on "
             f"{'/'.join(map(str, evals))} fixed held-out prompt/seed pairs (ODE) by all five rewards. Each cell: the "
             f"change from the base model at equal NFE ({eq_nfe:,.0f}, the last every run reaches; linear between "
             "evaluations), mean over seeds and pairs [95% interval: results/stats.py, the seeds and the pairs "
             "resampled].", "",
             "| file | trained reward | seeds | " + " | ".join(VIDEO_METRICS) + " |",
             "|---|---|---|" + "---|" * len(VIDEO_METRICS)]
    for f, name in VIDEO_FILES.items():
        for r in VIDEO_REWARDS:
            c = f"video_{f}_{r}"
            if c in cv:
                cells = [change(cv[c], "nfe", eq_nfe, m, config=c) for m in VIDEO_METRICS]
                lines.append(f"| {name} | {r} | {len(cv[c])} | " + " | ".join(cells) + " |")
    lines.append("")
    for f, name in VIDEO_FILES.items():  # the motion reward: trained on it against trained on a frame's reward
        for r in ("first", "mean"):
            a, b = f"video_{f}_motion", f"video_{f}_{r}"
            if a in cv and b in cv:
                d, lo, hi, _ = difference(cv, a, b, "nfe", eq_nfe, "toy_motion")
                lines.append(f"- {name}, toy_motion gain trained on motion minus trained on `{r}`: "
                             f"{st.fmt(d, lo, hi)} ({st.verdict(lo, hi)})")
    lines.append("")
    with open(os.path.join(out, "video.md"), "w") as fh:
        fh.write("\n".join(lines))
    return lines


def edit_table(out):
    """The editing comparison from <out>/raw/: per file, the change from the base model of the instruction, the
    preservation and the strict reward at equal NFE (the last NFE every run reaches), over seeds and pairs with its
    interval (results/stats.py); <out>/edit.md."""
    cv, eq_nfe, evals = finished_rows(out, "edit_")
    if not cv:
        return []
    lines = ["## Every file on the editing toy world, at equal NFE", "",
             "The editing toy (`--model toy-edit`: a FluxKontextPipeline of 2 M parameters, toy/make_edit_toy.py) "
             "trained by each file's TOY preset on `toy_edit` (the instruction carried out) and `toy_preserve` (the "
             "rest of the source kept), and scored on "
             f"{'/'.join(map(str, evals))} fixed held-out (instruction, source, seed) triples (ODE) by both and by "
             f"the 0/1 `toy_edit_strict`. Each cell: the change from the base model at equal NFE ({eq_nfe:,.0f}, "
             "the last every run reaches; linear between evaluations), mean over seeds and pairs [95% interval: "
             "results/stats.py, the seeds and the pairs resampled].", "",
             "| file | seeds | " + " | ".join(EDIT_METRICS) + " |", "|---|---|" + "---|" * len(EDIT_METRICS)]
    for f, name in VIDEO_FILES.items():
        c = f"edit_{f}"
        if c in cv:
            cells = [change(cv[c], "nfe", eq_nfe, m, config=c) for m in EDIT_METRICS]
            lines.append(f"| {name} | {len(cv[c])} | " + " | ".join(cells) + " |")
    lines.append("")
    with open(os.path.join(out, "edit.md"), "w") as fh:
        fh.write("\n".join(lines))
    return lines


def summarize(a):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    equal = equal_compute(os.path.join(a.out, "equal"))
    runs = load(a)
    if not runs and not equal:
        sys.exit(f"error: no finished runs under {os.path.join(a.out, 'raw')}; run without --summary-only first")
    if not runs:  # only the equal-compute comparison so far
        with open(os.path.join(a.out, "headline.md"), "w") as f:
            f.write("\n".join(equal))
        return print("\n".join(equal))
    cv = {c: [curves(r) for r in rs] for c, rs in runs.items()}
    metrics = [A, B, "train", S]
    eq_iter = min(x[-1]["iteration"] for xs in cv.values() for x in xs)
    eq_nfe = min(x[-1]["nfe"] for xs in cv.values() for x in xs)
    pairs = sorted({len(e[S]) for rs in runs.values() for r in rs for e in r["evals"].values()})
    lines = ["# Toy-world comparison (seeds per row in the n column)", "",
             f"Evaluation: ODE sampling, {'/'.join(map(str, pairs))} fixed held-out prompt/seed pairs. Cells: the mean "
             "over seeds and pairs, in brackets the change from the base model (iteration 0) and its 95% interval "
             "(results/stats.py: the seeds and the evaluation pairs resampled; none with one seed). NFE counts every "
             "transformer forward (sampling, ODE completions, training and reference forwards).", ""]
    papers = ["## The papers' tables on the toy", "",
              "Each row: the change from the base model (iteration 0), the mean over seeds and pairs [its 95% "
              "interval], of the training reward (mean of the two toy rewards) and of the strict metric (never trained "
              "on), at the table's equal iterations and equal NFE (the last point every row reaches; linear between "
              "evaluations). Intervals and verdicts: results/stats.py (the seeds of each row and the evaluation pairs "
              "resampled together, a t quantile for the smaller seed count; docs/results.md). Claims: the "
              "difference of the two rows' changes [its interval], at the last iteration and NFE both rows reach. "
              "'better' claims are supported when the interval lies above 0 in one metric with none below 0, not "
              "supported when one lies below 0 with none above, else unresolved; 'comparable' claims are supported "
              f"when the intervals of both differences lie within +- {MARGIN:.0%} of b's change (the margin), not "
              "supported when either lies beyond it.", ""]
    for title, rows, claims in TABLES.values():
        papers += paper_table(cv, runs, title, rows, claims)
    papers += ["### Other questions", "", *claim_rows(cv, QUESTIONS), ""]
    lines += papers
    for title, key, value in [(f"Equal iterations ({eq_iter})", "iteration", eq_iter),
                              (f"Equal NFE ({eq_nfe:,.0f} per run; linear between the two evaluations around it)", "nfe",
                               eq_nfe), ("Each run's last evaluation (its full budget)", None, None)]:
        lines += [f"## {title}", "", "| config | n | iterations | NFE | " + " | ".join(metrics) + " |",
                  "|---|---|---|---|" + "---|" * len(metrics)]
        for c, xs in cv.items():
            pick = (lambda x, m: x[-1][m]) if key is None else (lambda x, m: at(x, key, value, m))  # noqa: E731
            kept = [x for x in xs if pick(x, S) is not None]
            its, nfe = stats([pick(x, "iteration") for x in kept])[0], stats([pick(x, "nfe") for x in kept])[0]
            cells = [f"{stats([pick(x, m) for x in kept])[0]:.4f} ({change(xs, key, value, m, config=c)})"
                     for m in metrics]
            lines.append(f"| {c} | {len(kept)} | {its:.1f} | {nfe:,.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Cost", "", "Rollout NFE per prompt: the sampler plus every ODE completion, measured and the closed-form "
              "minimum (`perf/nfe_min_per_prompt`; G T for Flow-GRPO). All forwards per iteration: the rollout plus the "
              "training and reference forwards (G2RPO's training forward v(x_k) is one per prompt, shared by its group). "
              f"Seconds: training seconds per iteration on one thread, {a.workers} runs side by side (evaluation not "
              "counted).", "", "| config | rollout NFE per prompt | closed-form minimum | all forwards per iteration "
              "| seconds per iteration | training-batch rewards, mean of each run's last 5 iterations |",
              "|---|---|---|---|---|---|"]
    for c, rs in runs.items():
        rows = [r for run in rs for r in run["metrics"] if "perf/nfe_per_iteration" in r]
        tail = [r for run in rs for r in run["metrics"][-5:] if "perf/nfe_per_iteration" in r]
        trained = sorted({k[7:-5] for r in tail for k in r if k.startswith("reward/") and k.endswith("_mean")})
        mean = lambda k, rs=rows: stats([r[k] for r in rs if k in r])[0]  # noqa: E731
        lines.append(f"| {c} | {mean('perf/nfe_rollout_per_prompt'):,.0f} | {stats([closed_form(r) for r in rs])[0]:,.0f} | "
                     f"{mean('perf/nfe_per_iteration'):,.0f} | {mean('perf/seconds_per_iteration'):.1f} | "
                     + ", ".join(f"{k} {stats([r[f'reward/{k}_mean'] for r in tail])[0]:.3f}" for k in trained) + " |")
    base_all = {m: stats([x[0][m] for xs in cv.values() for x in xs])[0] for m in metrics}
    lines += ["", "Base model (iteration 0, every run): " + ", ".join(f"{m} {v:.4f}" for m, v in base_all.items()), ""]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tables.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(a.out, "headline.md"), "w") as f:  # the README's tables
        f.write("\n".join(equal + papers))

    def band(ax, configs, x_key, metric):
        """The mean over seeds at each evaluation every seed has, and its 95% interval where n > 1."""
        for c in configs:
            if c not in cv:
                continue
            xv, m, _, Y = resampled_curve(cv[c], x_key, metric, config=c, absolute=True)
            ax.plot(xv, m, marker="o", ms=3, label=f"{c} (n = {len(cv[c])})")
            if len(cv[c]) > 1:
                band = [st.interval(Y[:, k], seeds=len(cv[c])) for k in range(len(m))]
                ax.fill_between(xv, [b[0] for b in band], [b[1] for b in band], alpha=0.2)

    names = {A: "colour/position reward", B: "shape/count reward", S: "strict accuracy", "train": "training reward (mean)"}
    xlabels = {"iteration": "iteration", "nfe": "NFE (transformer forwards)", "seconds": "training time (s, one thread)"}
    for fig_name, (question, configs) in FIGURES.items():
        rows_m = [A, B, S] if fig_name == "reward_hacking" else ["train", S]
        fig, axes = plt.subplots(len(rows_m), 3, figsize=(13, 3.3 * len(rows_m)), squeeze=False)
        for i, m in enumerate(rows_m):
            for j, x_key in enumerate(xlabels):
                band(axes[i, j], configs, x_key, m)
                axes[i, j].set(xlabel=xlabels[x_key], ylabel=f"{names[m]} (ODE eval)")
                axes[i, j].grid(alpha=0.3)
        if axes[0, 0].get_legend_handles_labels()[0]:
            axes[0, 0].legend(fontsize=8)
        fig.suptitle(f"{question}\nmean over seeds (band: its 95% interval, seeds and pairs resampled); ODE evaluation on "
                     f"{'/'.join(map(str, pairs))} held-out pairs", fontsize=10)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, f"{fig_name}.png"), dpi=100)
        plt.close(fig)
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--equal", action="store_true", help="the equal-compute comparison of every file (EQUAL)")
    p.add_argument("--video", action="store_true", help="the moving-shapes comparison (VIDEO): first-frame, mean "
                   "and motion rewards as the trained reward")
    p.add_argument("--edit", action="store_true", help="the editing comparison (EDIT): every file's preset on "
                   "the editing toy world")
    p.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS), metavar="CONFIG")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: each config's own count (CONFIGS)")
    p.add_argument("--workers", type=int, default=2, help="runs side by side, one thread each")
    p.add_argument("--budget-nfe", type=float, default=61_440, help="NFE per run (= 20 Flow-GRPO iterations; --equal: 60)")
    p.add_argument("--min-iterations", type=int, default=10)
    p.add_argument("--iterations", type=int, default=0, help="if > 0: this many iterations for every config")
    p.add_argument("--eval-every", type=int, default=5, help="(--equal: 10)")
    p.add_argument("--eval-num", type=int, default=256)
    p.add_argument("--extra", default="", help="flags appended to every run (e.g. smaller groups for a smoke test)")
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "compare"))
    p.add_argument("--out", default=os.path.join(ROOT, "results", "compare"))
    p.add_argument("--summary-only", action="store_true")
    a = p.parse_args()
    if a.equal or a.video or a.edit:  # its own budget, evaluation interval and directories, unless given
        given = {x.split("=")[0][2:].replace("-", "_") for x in sys.argv[1:] if x.startswith("--")}
        for key, value in (VIDEO_SETTINGS if a.video else EDIT_SETTINGS if a.edit else EQUAL_SETTINGS).items():
            setattr(a, key, getattr(a, key) if key in given else value)
    chosen = VIDEO if a.video else EDIT if a.edit else EQUAL if a.equal else {c: v[2] for c, v in CONFIGS.items()}
    a.configs = a.configs or [c for c in CONFIGS if chosen.get(c, 0)]
    if a.workers < 1 or a.eval_every < 1 or a.min_iterations < 1 or a.budget_nfe <= 0:
        sys.exit("error: --workers, --eval-every and --min-iterations must be >= 1 and --budget-nfe > 0")
    if not a.summary_only:
        run_all(a)
    if a.video or a.edit:
        return print("\n".join((video_table if a.video else edit_table)(a.out)))
    if a.equal:  # the summary of both comparisons: the papers' runs beside equal/
        a = argparse.Namespace(**{**vars(a), "equal": False, "seeds": None, "out": os.path.dirname(a.out),
                                  "configs": [c for c in CONFIGS if CONFIGS[c][2]]})
    summarize(a)


if __name__ == "__main__":
    main()
