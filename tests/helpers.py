"""Shared test helpers: tiny random pipelines on disk and a runner for the algorithm scripts."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_model_dirs(root):
    """Save a tiny random FluxPipeline and StableDiffusion3Pipeline (and a prompt file) under `root` once."""
    from tiny import build_flux, build_sd3

    paths = {k: os.path.join(root, k) for k in ("flux", "sd3")}
    if not os.path.isdir(paths["flux"]):
        build_flux(dynamic_shifting=True).save_pretrained(paths["flux"])  # FLUX.1-dev's scheduler config
        build_sd3().save_pretrained(paths["sd3"])
    paths["prompts"] = os.path.join(root, "prompts.txt")
    with open(paths["prompts"], "w") as f:
        f.write("a red circle on the left\na blue square on the top\na green triangle\n")
    return paths


def tiny_flags(model, prompts, out, **over):
    flags = {"model": model, "mixed-precision": "no", "resolution": 32, "max-sequence-length": 16, "prompts": prompts,
             "eval-prompts": prompts, "rewards": "jpeg", "num-steps": 4, "eval-steps": 4, "group-size": 4,
             "prompts-per-iteration": 2, "micro-batch": 4, "num-iterations": 2, "eval-every": 2, "eval-num": 4,
             "save-every": 1, "output-dir": out, "lora-rank": 4, "lora-alpha": 8, "log-images-every": 1}
    flags.update({k.replace("_", "-"): v for k, v in over.items()})
    args = []
    for k, v in flags.items():
        if v is True:
            args.append(f"--{k}")
        elif v is not None:
            args += [f"--{k}", *str(v).split()]
    return args


def run_script(script, args, nproc=1, check=True, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    proc = subprocess.run(launcher + [os.path.join(ROOT, script)] + list(args), capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(out_dir):
    """Every metrics.jsonl line of the single run under out_dir, merged per iteration."""
    (run,) = [d for d in os.listdir(out_dir)]
    merged = {}
    with open(os.path.join(out_dir, run, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            merged.setdefault(row["iteration"], {}).update(row)
    return os.path.join(out_dir, run), merged


def check_args(module, world=1, **over):
    """module.check_args on the module's default Args with some fields overridden."""
    args = module.Args()
    for k, v in over.items():
        setattr(args, k, v)
    module.check_args(args, world=world)
