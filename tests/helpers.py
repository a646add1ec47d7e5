"""Shared test helpers: tiny random pipelines on disk and a runner for the algorithm scripts."""
import json
import os
import subprocess
import sys
import threading

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


def run_script(script, args, nproc=1, check=True, timeout=600, fresh=False):
    """Run a script of this project with `args` and return its (returncode, stdout, stderr): in this process, where
    torch and diffusers are already imported (one thread, warnings off, as a new process would run it), or in new
    processes where a test needs them: `nproc` > 1 (run_ranks) or `fresh` (a new interpreter, e.g. to be
    killed)."""
    if nproc == 1 and not fresh:
        proc = run_here(script, args)
    else:
        env = script_env()
        cmd = [sys.executable, os.path.join(ROOT, script), *map(str, args)]
        if nproc > 1:
            proc = run_ranks(cmd, nproc, env=env, timeout=timeout, forked=True)
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def script_env():
    """The environment of a script's new processes: one thread each, warnings off."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")


def run_ranks(cmd, nproc, *, env, timeout, forked=False):
    """`cmd` as `torchrun --standalone --nproc_per_node nproc` starts it: one process per rank with RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and, when one rank fails, the others stopped;
    without torchrun's own launcher process (an interpreter that imports torch, 2 CPU-s a test). With `forked`
    (`cmd`: the interpreter and a script), the ranks are forked by tests/fork_server.py, which imported torch
    and diffusers once (~5 CPU-s a rank saved; what else differs: its docstring). The ranks' stdout and stderr
    are joined in rank order; the return code is the first failed rank's, else 0."""
    import socket
    import tempfile

    with socket.socket() as s:  # a free port for the group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port)) for rank in range(nproc)]
    with tempfile.TemporaryDirectory() as tmp:
        files = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(nproc)]
        for path in sum(files, ()):  # there to read even if a rank dies before it opens its own
            open(path, "w").close()
        if forked:
            assert cmd[0] == sys.executable and cmd[1].endswith(".py"), cmd
            reply = fork_request(env, {"argv": cmd[1:], "ranks": ranks, "out": [o for o, _ in files],
                                       "err": [e for _, e in files], "timeout": timeout})
            codes, first, timed_out = reply["codes"], reply["first"], reply["timed_out"]
        else:
            codes, first, timed_out = popen_ranks(cmd, ranks, files, env=env, timeout=timeout)
        text = []
        for out, err in files:
            with open(out) as o, open(err) as e:
                text.append((o.read(), e.read()))
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout)
    code = first or next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(cmd, code, "".join(o for o, _ in text), "".join(e for _, e in text))


def popen_ranks(cmd, ranks, files, *, env, timeout):
    """run_ranks' ranks as new processes: their return codes, the first failed one's code, whether it timed
    out."""
    import time

    procs = []
    for rank_env, (out, err) in zip(ranks, files):
        with open(out, "w") as o, open(err, "w") as e:
            procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, text=True, cwd=ROOT,
                                          env=dict(env, **rank_env)))
    deadline, first = time.time() + timeout, 0
    try:
        while None in [p.poll() for p in procs]:  # every rank polled
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or time.time() > deadline:
                first = failed[0] if failed else first
                break
            time.sleep(0.05)
        timed_out = time.time() > deadline and any(p.poll() is None for p in procs)
    finally:
        for p in procs:  # a failed rank's others would wait at its next collective: stopped, as torchrun does
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], first, timed_out


SERVERS = {}  # the environment a fork server was started with (PYTEST_CURRENT_TEST aside) -> the server
SERVERS_LOCK = threading.Lock()
FORKED_CPU = [0.0]  # the CPU seconds of the fork servers and their ranks so far (tests/conftest.py's CPU log)


def fork_request(env, request):
    """Send `request` to the fork server started with `env` (started at its first request: it imports torch
    and diffusers, ~10 s) and return its reply. A server that does not start, stops, answers out of turn or
    not within the request's deadline and a minute (to stop the ranks) is killed, its ranks with it, and the
    request is an error."""
    import atexit
    import tempfile

    env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}  # pytest sets it anew for each test
    key = tuple(sorted(env.items()))
    with SERVERS_LOCK:
        if not SERVERS:
            atexit.register(stop_fork_servers)
        if key not in SERVERS or SERVERS[key]["process"].poll() is not None:
            errors = tempfile.TemporaryFile()
            script = os.path.join(ROOT, "tests", "fork_server.py")
            server = subprocess.Popen([sys.executable, script], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=errors)
            SERVERS[key] = {"process": server, "lock": threading.Lock(), "errors": errors, "id": 0}
            if read_line(server, timeout=600) != '{"ready": true}\n':
                stop_fork_server(SERVERS.pop(key), now=True)
                errors.seek(0)
                raise RuntimeError(f"tests/fork_server.py did not start:\n{errors.read().decode()[-3000:]}")
        entry = SERVERS[key]
    with entry["lock"]:
        entry["id"] += 1
        request = dict(request, id=entry["id"], env=env)
        try:
            entry["process"].stdin.write((json.dumps(request) + "\n").encode())
            entry["process"].stdin.flush()
            line = read_line(entry["process"], timeout=request["timeout"] + 60)
            reply = json.loads(line) if line else None
            if reply is None or reply["id"] != request["id"]:
                raise RuntimeError(f"tests/fork_server.py stopped or did not answer in time ({line!r})")
        except BaseException:  # a server whose next reply would be this request's: killed with its ranks
            with SERVERS_LOCK:
                SERVERS.pop(key, None)
            stop_fork_server(entry, now=True)
            raise
    FORKED_CPU[0] += reply["cpu"]
    return reply


def read_line(process, *, timeout):
    """A line of `process`'s stdout within `timeout` seconds, else what came ('' at once if it stopped)."""
    import select
    import time

    deadline, fd, data = time.time() + timeout, process.stdout.fileno(), b""
    while not data.endswith(b"\n"):
        if not select.select([fd], [], [], max(0.0, deadline - time.time()))[0]:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    return data.decode()


def stop_fork_server(entry, *, now=False):
    """Close a fork server's stdin (it ends its loop) and wait for it; kill it (its ranks die with it) `now`
    or if it does not stop within 10 s."""
    process = entry["process"]
    try:
        if not now:
            process.stdin.close()
            process.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if process.poll() is None:
        process.kill()
        process.wait()
    entry["errors"].close()


def stop_fork_servers():
    """At exit: every fork server stopped."""
    with SERVERS_LOCK:
        for entry in SERVERS.values():
            stop_fork_server(entry)
        SERVERS.clear()


HERE = threading.Lock()  # one script at a time in this process (sys.argv, the cwd, stdout are global)


def run_here(script, args):
    """A script's main block run in this process as `python script args` would run it: its exit code (a
    SystemExit's message goes to stderr, an exception's traceback too), its stdout and stderr."""
    import contextlib
    import io
    import runpy
    import traceback
    import warnings

    import torch
    assert not torch.distributed.is_initialized(), "an earlier test left a process group initialized in this process"
    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, cwd, threads = sys.argv, os.getcwd(), torch.get_num_threads()
    path = os.path.join(ROOT, script)
    HERE.acquire()
    try:
        sys.argv = [path, *map(str, args)]
        os.chdir(ROOT)
        torch.set_num_threads(1)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except Exception:  # a traceback, as a process would print it
                traceback.print_exc()
                code = 1
    finally:
        release_run_directories()
        sys.argv = argv
        os.chdir(cwd)
        torch.set_num_threads(threads)
        HERE.release()
    return subprocess.CompletedProcess(sys.argv, code, out.getvalue(), err.getvalue())


def read_metrics(out_dir):
    """Every metrics.jsonl line of the single run under out_dir, merged per iteration."""
    (run,) = [d for d in os.listdir(out_dir)]
    merged = {}
    with open(os.path.join(out_dir, run, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            merged.setdefault(row["iteration"], {}).update(row)
    return os.path.join(out_dir, run), merged


def crashed_copy(out_dir, dst, *, after: int) -> str:
    """A copy of the run in `out_dir` as if it had crashed after its checkpoint at iteration `after`: the later
    checkpoints removed (what it logged later stays, for --resume to drop). Returns the copy's run directory."""
    import shutil

    (name,) = os.listdir(out_dir)
    shutil.copytree(os.path.join(out_dir, name), os.path.join(dst, name))
    root = os.path.join(dst, name, "checkpoints")
    for d in os.listdir(root):
        if int(d.split("_")[1].split(".")[0]) > after:
            shutil.rmtree(os.path.join(root, d))
    return os.path.join(dst, name)


def check_args(module, world=1, **over):
    """module.check_args on the module's default Args with some fields overridden."""
    args = module.Args()
    for k, v in over.items():
        setattr(args, k, v)
    module.check_args(args, world=world)


def run_in_process(script, args, monkeypatch, wrap=None):
    """Run an algorithm file's main block in this process (threads: 1), each name in `wrap` (a function the file
    defines or imports) replaced in the file's namespace by wrap[name](that function) before the main block runs."""
    import torch
    path = os.path.join(ROOT, script)
    with open(path) as f:
        source = f.read()
    marker = 'if __name__ == "__main__":'
    assert source.count(marker) == 1
    hooks = "".join(f"{name} = __wrap__[{name!r}]({name})\n" for name in wrap or {})
    monkeypatch.setattr(sys, "argv", [script] + [str(a) for a in args])
    assert not torch.distributed.is_initialized(), "an earlier test left a process group initialized in this process"
    torch.set_num_threads(1)
    try:
        exec(compile(source.replace(marker, hooks + marker), path, "exec"),
             {"__name__": "__main__", "__file__": path, "__wrap__": wrap or {}})
    finally:
        release_run_directories()


def release_run_directories():
    """The run directory locks a run in this process left held (a run that stopped before its end), and the
    signal handlers it installed back to this process's."""
    if "rundir" in sys.modules:
        sys.modules["rundir"].release_run_directories()
        sys.modules["rundir"].restore_signals()


def write_edit_set(folder, prompts: list, *, name: str = "edits.jsonl") -> str:
    """Editing toy-world prompts (toy/edit_world.py) as a .jsonl prompt set in `folder`: each source a PNG, each
    row {"prompt", "image", "source", "target", "changed"}. Returns the file's path."""
    from PIL import Image
    rows = []
    for i, p in enumerate(prompts):
        Image.fromarray(p.images[0].permute(1, 2, 0).numpy()).save(os.path.join(folder, f"{i}.png"))
        rows.append(json.dumps({"prompt": str(p), "image": f"{i}.png", **p.metadata}))
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")
    return path


def learning_runs(tmp_path_factory, worlds: dict, *, base: str, timeout: float) -> dict:
    """The learning tests' runs: for each world (a --model) its (cases, pairs, flags): each case name: (script,
    iterations, flags) trained in that world for its iterations, with the world's flags, and evaluated on `pairs`
    held-out pairs at the end (`base` also at 0: every TOY preset samples a world's pairs alike). All of them in
    turn in one process (tests/run_in_turn.py: torch and diffusers imported once), one thread: with pytest's other
    worker beside it, as many busy processes as the machine has cores. {world: {name: (output dir, exit code,
    log)}}."""
    logs, out, turn = tmp_path_factory.mktemp("logs"), {}, []
    for world, (cases, pairs, flags) in worlds.items():
        for name, (script, iterations, extra) in cases.items():
            out[world, name] = str(tmp_path_factory.mktemp(f"{world}-{name}"))
            args = ["--model", world, "--output-dir", out[world, name], "--num-iterations", str(iterations),
                    "--eval-every", str(iterations), "--eval-num", str(pairs), "--save-every", "0",
                    "--log-images-every", "0", *extra, *flags, *([] if name == base else ["--no-eval-base"])]
            turn.append([f"{world}-{name}", script, args])
    (logs / "runs.json").write_text(json.dumps(turn))
    cmd = [sys.executable, os.path.join(ROOT, "tests", "run_in_turn.py"), str(logs / "runs.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:]  # a run that fails is its case's failure
    result = {world: {} for world in worlds}
    for world, name in out:
        code, log = (logs / f"{world}-{name}.log").read_text().split("\n", 1)
        result[world][name] = (out[world, name], int(code), log)
    return result


def learning_gain(runs: dict, name: str, *, cases: dict, base: str, metrics: tuple) -> tuple:
    """A learning run's held-out gain in the mean of `metrics` (e.g. its training rewards) against the base
    evaluation of the `base` run, its paired standard error (printed) and its run directory; the run must have
    exited 0."""
    out, code, log = runs[name]
    assert code == 0, log[-3000:]
    run, _ = read_metrics(out)
    first, _ = read_metrics(runs[base][0])
    iterations = cases[name][1]
    evals = (json.load(open(os.path.join(r, f"eval_{i}.json"))) for r, i in ((first, 0), (run, iterations)))
    before, after = ([sum(v) / len(v) for v in zip(*(e[m] for m in metrics))] for e in evals)
    gain, se = paired(before, after)
    n, what = len(before), " + ".join(metrics)
    print(f"{name}: {what} {sum(before) / n:.4f} -> {sum(after) / n:.4f}, gain {gain:+.4f} +- {se:.4f} (paired "
          f"SE, {gain / se:+.1f} SE)")
    return gain, se, run


def paired(before: list, after: list) -> tuple:
    """The mean change over the same pairs and its paired standard error."""
    d = [b - a for a, b in zip(before, after)]
    mean = sum(d) / len(d)
    return mean, (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
