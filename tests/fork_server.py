"""Start the ranks of the tests' 2-process runs without importing torch and diffusers again in each: this
process imports them once, in the environment it was started with (tests/helpers.fork_request keys a server on
that environment, PYTEST_CURRENT_TEST aside), says "ready", then, for each request read from stdin (a JSON
line), forks one child per rank. A child takes the request's environment and its rank's variables, sends its
stdout and stderr to the given files and runs the script as `python script args` would: its SystemExit or
exception leaves through this file's top level, so the interpreter prints it (sys.excepthook) and shuts down
as after any script (threads joined, atexit handlers run, exit code 1 or the SystemExit's, -2 on Ctrl-C); a
child dies with this server (PR_SET_PDEATHSIG). When one rank fails the others are stopped (SIGTERM, then
SIGKILL), as torchrun stops them; past the deadline all are. The reply is a JSON line on a private copy of the
server's stdout (what a library prints goes to stderr): the request's id, each rank's return code (-N: killed
by signal N), the code of the rank seen failing first, whether the deadline passed, and the CPU seconds of the
ranks and of this server since its last reply (its imports in the first). What differs from new processes: the
ranks share this process's hash seed and whatever state its imports left (the project seeds its own
generators). Nothing of this project is imported here: a copied file's own common.py must be the one its run
imports."""
import ctypes
import json
import os
import resource
import runpy
import signal
import sys
import threading
import time

import diffusers  # noqa: F401  what every script imports, once (~5 CPU-s a process)
import peft  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.utils.tensorboard  # noqa: F401
import transformers  # noqa: F401
import tyro  # noqa: F401
from diffusers import FluxPipeline, StableDiffusion3Pipeline  # noqa: F401

PR_SET_PDEATHSIG = 1


def child(request, rank, reply):
    """In the forked child: become the rank's process and run the script; never returns (its SystemExit or
    exception unwinds to the top level, where the interpreter ends the process as it ends a script's)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != request["server"]:  # the server died before the line above
        os._exit(1)
    os.close(reply)  # its file object does not close it again (closefd=False)
    os.environ.clear()
    os.environ.update(request["env"], **request["ranks"][rank])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["out"][rank]), (2, request["err"][rank])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)


def serve(request, reply, last):
    """Fork the request's ranks, wait for them as torchrun does, and return the reply."""
    pids, used = [], resource.getrusage(resource.RUSAGE_CHILDREN)
    sys.stdout.flush(), sys.stderr.flush()
    request["server"] = os.getpid()
    for rank in range(len(request["ranks"])):
        pid = os.fork()
        if pid == 0:
            child(request, rank, reply)
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
    now, own = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime + own.ru_utime + own.ru_stime - last[0]
    last[0] = own.ru_utime + own.ru_stime
    return {"id": request["id"], "codes": codes, "timed_out": timed_out, "first": first, "cpu": cpu}


def main():
    threads = len(os.listdir("/proc/self/task"))
    if threading.active_count() != 1 or threads != 1:  # a fork copies only the forking thread
        sys.exit(f"error: fork_server.py has {threads} threads after its imports; it forks only with one")
    reply = os.dup(1)  # the replies' channel; what anything else prints goes to stderr
    os.dup2(2, 1)
    last = [0.0]
    out = os.fdopen(reply, "w", closefd=False)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        print(json.dumps(serve(json.loads(line), reply, last)), file=out, flush=True)


if __name__ == "__main__":
    main()
