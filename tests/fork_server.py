"""Start the ranks of the tests' 2-process runs without importing torch and diffusers again in each: this
process imports them once (as a script's process would, in the environment it was started with), then, for
each request read from stdin (a JSON line), forks one child per rank. Each child sets its rank's variables,
sends its stdout and stderr to the given files and runs the script as `python script args` would (runpy; its
SystemExit or traceback; the atexit handlers); when one rank fails the others are stopped (SIGTERM, then
SIGKILL), as torchrun stops them; past the deadline all are. The reply is a JSON line: each rank's return code
(-N: killed by signal N), the code of the rank seen failing first, whether the deadline passed, and the ranks'
CPU seconds. Nothing of this project is imported here (a copied file's own common.py must be the one its run
imports). Used by tests/helpers.run_ranks; an import costs ~5 CPU-s a process."""
import atexit
import json
import os
import resource
import runpy
import signal
import sys
import time
import traceback

import diffusers  # noqa: F401  what every script imports, once
import peft  # noqa: F401
import torch
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.utils.tensorboard  # noqa: F401
import transformers  # noqa: F401
import tyro  # noqa: F401
from diffusers import FluxPipeline, StableDiffusion3Pipeline  # noqa: F401


def child(argv, rank_env, out, err):
    """In the forked child: run the script as its own process would, and exit with its code."""
    os.environ.update(rank_env)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # a traceback, as the interpreter prints it
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def serve(request):
    """Fork the request's ranks, wait for them as torchrun does, and return the reply."""
    pids, used = [], resource.getrusage(resource.RUSAGE_CHILDREN)
    sys.stdout.flush()
    for rank, rank_env in enumerate(request["ranks"]):
        pid = os.fork()
        if pid == 0:
            child(request["argv"], rank_env, request["out"][rank], request["err"][rank])
        pids.append(pid)
    codes, deadline = [None] * len(pids), time.time() + request["timeout"]
    stopping, timed_out, first = None, False, 0
    while None in codes:
        for i, pid in enumerate(pids):
            if codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        failed = any(c not in (None, 0) for c in codes)
        if (failed or time.time() > deadline) and stopping is None and None in codes:
            stopping, timed_out = time.time(), not failed  # the others would wait at their next collective
            first = next((c for c in codes if c not in (None, 0)), 0)
            for i, pid in enumerate(pids):
                if codes[i] is None:
                    os.kill(pid, signal.SIGTERM)
        if stopping is not None and time.time() > stopping + 10:
            for i, pid in enumerate(pids):
                if codes[i] is None:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    return {"codes": codes, "timed_out": timed_out, "first": first, "cpu": cpu}

if __name__ == "__main__":
    for line in sys.stdin:
        print(json.dumps(serve(json.loads(line))), flush=True)
