"""The warm interpreter of .ci/bench-smoke (run as `PY .ci/bench_smoke_warm.py TIMEOUT FD SOCKET SHIM`).

Importing torch, transformers and peft costs about 6 CPU s a process, more than most smoke modes' own work, and a
smoke run starts some forty Python processes. This process imports those libraries once (never gradian: every
process imports this checkout's own, fresh), runs no torch op (a fork must not inherit a started thread pool), and
forks a child for every Python process the smoke run starts:

* the bench scripts: a JSON line on stdin, {"id", "script", "out", "err"}; the child runs `script --smoke` as a fresh
  `python script --smoke` would, and once it is reaped {"id", "status", "cpu_s"} goes to the pipe FD;
* what the scripts start themselves (`python -m gradian ...`, torchrun and its ranks, `python -c ...`, their own
  `--_child` processes): in each child `subprocess` runs the interpreter `sys.executable` through SHIM, a small
  stand-in that passes its command line, environment, directory and stdin/stdout/stderr over the unix socket
  SOCKET and gets the child's exit status back (and forwards the signals it is sent). A command line SHIM does not
  know (any option but -u, -m, -c, -, a script) runs the real interpreter instead.

A child is set up as the interpreter would set up that command (sys.argv, sys.path from its PYTHONPATH and
directory, `__main__`, its environment, buffering, exit status, atexit). CPU seconds: each script's reply counts its
own process tree and every forked process started on its behalf (tagged by BENCH_SMOKE_TAG in their environment).
One thread, polling with select: no lock can be held by another thread at a fork. A script still running after
TIMEOUT s has its process group killed, and so has a forked process whose SHIM went away (killed, timed out).
"""

import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
import types

timeout, ctl, sock_path, shim = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
# listening before the imports: a SHIM that connects meanwhile waits in the backlog instead of finding no socket
# (and running the real interpreter)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sock_path)
listener.listen(64)

import torch  # noqa: E402,F401  the shared imports: what gradian's verbs and the benches load

for _name in ("numpy", "scipy.stats", "sklearn.cluster", "transformers", "transformers.models.llama.modeling_llama",
              "peft", "datasets", "trl", "safetensors.torch", "yaml", "jinja2", "rich.progress", "pydantic", "typer"):
    try:
        __import__(_name)
    except ImportError:  # not installed here: a process that needs it fails on its own, as it would unforked
        pass

REAL = sys.executable
OWN_PP = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
BASE_PATH = [p for p in sys.path[1:] if p not in OWN_PP and p not in map(os.path.abspath, OWN_PP)]
scripts = {}  # pid -> (id, deadline, tag)
forked = {}  # pid -> (connection, tag)
conns = {}  # connection -> pid
tag_cpu: dict = {}
_popen_execute = subprocess.Popen._execute_child


def _via_shim(self, args, executable, *rest):
    """subprocess: `sys.executable ...` through SHIM (a forked child of this process), the rest as it is."""
    if executable is None and isinstance(args, (list, tuple)) and args and os.fspath(args[0]) == REAL:
        args = [shim, *args[1:]]
    return _popen_execute(self, args, executable, *rest)


def finish(code_of):
    """Run `code_of()` as a program's main and leave the process as the interpreter would: its exit status."""
    code = 0
    try:
        code_of()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        import atexit
        import threading

        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    finally:
        os._exit(code)


def settle(fds, env, cwd, path0, unbuffered=False):
    """The child's standard streams, environment, directory and sys.path; the others' descriptors closed."""
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    for fd in [*fds, ctl, listener.fileno(), *(c.fileno() for c in conns)]:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    pp = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [path0, *pp, *BASE_PATH]
    sys.stdin = open(0, closefd=False)
    if unbuffered:  # -u: no buffer under the text layer
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    else:
        sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    subprocess.Popen._execute_child = _via_shim


def run_script(req):
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    script = req["script"]
    settle([devnull, out, err], {**os.environ, "BENCH_SMOKE_TAG": str(req["id"])}, os.getcwd(),
           os.path.dirname(script))
    sys.argv = [script, "--smoke"]
    finish(lambda: runpy.run_path(script, run_name="__main__"))


def run_command(fds, argv, env, cwd):
    """`python ARGV` in this forked child (SHIM checked that ARGV is one of these forms)."""
    os.setsid()
    unbuffered = argv[0] == "-u"
    argv = argv[1:] if unbuffered else argv
    if argv[0] == "-m":
        settle(fds, env, cwd, cwd, unbuffered)
        sys.argv = [argv[1], *argv[2:]]
        finish(lambda: runpy._run_module_as_main(argv[1]))
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    if argv[0] in ("-c", "-"):
        settle(fds, env, cwd, "", unbuffered)
        sys.argv = [argv[0], *argv[2:]] if argv[0] == "-c" else argv
        code = argv[1] if argv[0] == "-c" else sys.stdin.read()
        sys.modules["__main__"] = main
        finish(lambda: exec(compile(code, "<string>" if argv[0] == "-c" else "<stdin>", "exec"), main.__dict__))
    script = os.path.join(cwd, argv[0])
    settle(fds, env, cwd, os.path.dirname(os.path.abspath(script)), unbuffered)
    sys.argv = argv
    finish(lambda: runpy.run_path(argv[0], run_name="__main__"))


def in_child(fn, *args):
    """A forked child never returns into this loop: whatever goes wrong in setting it up, it exits."""
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)


def recv_exact(conn, n):
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise EOFError
        data += part
    return data


def accept():
    conn, _ = listener.accept()
    try:
        head, fds, _, _ = socket.recv_fds(conn, 8, 3)
        head += recv_exact(conn, 8 - len(head)) if len(head) < 8 else b""
        req = json.loads(recv_exact(conn, struct.unpack("!Q", head)[0]))
    except (EOFError, OSError, ValueError):
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        in_child(run_command, fds, req["argv"], req["env"], req["cwd"])
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    forked[pid] = (conn, req["env"].get("BENCH_SMOKE_TAG", ""))
    conns[conn] = pid


def kill(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


buf, eof = b"", False
while not (eof and not scripts):
    ready, _, _ = select.select(([] if eof else [0]) + [listener, *conns], [], [], 0.05)
    for r in ready:
        if r == 0:
            data = os.read(0, 65536)
            eof = not data
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    in_child(run_script, req)
                scripts[pid] = (str(req["id"]), time.time() + timeout)
        elif r is listener:
            accept()
        else:  # a SHIM sends nothing after its request: readable means it went away, and so must its process
            try:
                gone = r.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                gone = True
            if gone:
                kill(conns.pop(r))
                r.close()
    for pid, (conn, tag) in list(forked.items()):
        done, status, ru = os.wait4(pid, os.WNOHANG)
        if done:
            del forked[pid]
            tag_cpu[tag] = tag_cpu.get(tag, 0.0) + ru.ru_utime + ru.ru_stime
            if conn in conns:
                del conns[conn]
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    for pid, (rid, deadline) in list(scripts.items()):
        done, status, ru = os.wait4(pid, os.WNOHANG)
        if done:
            del scripts[pid]
            rep = {"id": int(rid), "status": status, "cpu_s": ru.ru_utime + ru.ru_stime + tag_cpu.pop(rid, 0.0)}
            os.write(ctl, (json.dumps(rep) + "\n").encode())
        elif time.time() > deadline:
            kill(pid)
for pid, (conn, tag) in forked.items():  # what a script left running: nothing waits for it any more
    kill(pid)
    _, _, ru = os.wait4(pid, 0)
    tag_cpu[tag] = tag_cpu.get(tag, 0.0) + ru.ru_utime + ru.ru_stime
os.write(ctl, (json.dumps({"tags": tag_cpu}) + "\n").encode())  # the forked processes of the .sh scripts
listener.close()
