"""The warm server: imports torch, Lightning and lightning_par once, then forks every Python command a test starts
through tests/warm/python (tests/warm_client.py), so that the command skips the 5 s its imports take. A command run
this way runs as the interpreter runs it: its own ``__main__``, arguments, directory, environment, ``sys.path`` and
standard streams (the client's open files, by number), its random seeds drawn afresh, ``sys.excepthook`` for what
it raises, its threads joined and ``atexit`` handlers run at the end. Processes it starts with ``sys.executable``
are warm too. What the imports print goes to the server's log, not to the command's standard error: a test that
holds everything a command prints, its start included, runs it cold (``sys.executable``).

Usage: ``python tests/warm_server.py SOCKET``. It listens once its imports are done (a client finding no server runs
cold), and ends with the process that started it.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import fcntl
import importlib
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import types
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
WARM_PYTHON = TESTS / "warm" / "python"
MAX_FILES = 256
_PR_SET_PDEATHSIG = 1


def main(path: str) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # gone with the test session
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = f"{path}.{os.getpid()}"
    listener.bind(staging)
    listener.listen(64)
    os.replace(staging, path)  # clients connect only once the imports are done
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped as they end
    while True:
        connection, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            try:
                listener.close()
                _monitor(connection)
            finally:
                os._exit(1)  # never back into the server's loop
        connection.close()


def _preload() -> None:
    """Import what the commands need (what the imports print goes to the server's log)."""
    from harness import PRELOADED

    # Not torch.distributed.run: `-m torch.distributed.run` would warn that it was imported before it ran.
    for module in [*PRELOADED, "lightning.pytorch.cli", "lightning_par.cli.main", "lightning_par.cli.lightning_cli",
                   "tensorboard"]:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()


def _monitor(connection: socket.socket) -> None:
    """Fork the client's command, pass on the signals the client caught, kill the command if the client is gone,
    and send the client the command's exit status (negative: the signal that ended it)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, files = _receive(connection)
    pid = os.fork()
    if pid == 0:
        try:
            connection.close()
            _run(request, files)
        finally:
            os._exit(1)
    for fd in files:
        os.close(fd)
    ended = os.pidfd_open(pid)
    watched = [connection, ended]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if ended in ready:
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            try:
                connection.sendall(struct.pack("!i", status))
            except OSError:
                pass
            os._exit(0)
        message = connection.recv(4)
        if len(message) == 4:
            os.kill(pid, struct.unpack("!i", message)[0])
        else:  # the client was killed: so is its command
            os.kill(pid, signal.SIGKILL)
            watched = [ended]


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, files, _, _ = socket.recv_fds(connection, 1 << 16, MAX_FILES)
    size = struct.unpack("!I", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            raise ConnectionError("the client went away before its request was whole")
        data += more
    return json.loads(data), list(files)


def _run(request: dict[str, Any], files: list[int]) -> None:
    """In the forked command: take the client's place, run its command, exit as the interpreter would."""
    _take_files(files, request["fds"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    server_entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ.clear()
    os.environ.update(request["env"])
    arguments = request["argv"]
    unbuffered = arguments[:1] == ["-u"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    arguments = arguments[1:] if arguments[:1] == ["-u"] else arguments
    if unbuffered:
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.executable = str(WARM_PYTHON)
    if arguments[0] == "-m":
        first = os.getcwd()
    elif arguments[0] == "-c":
        first = ""
    else:
        first = os.path.dirname(os.path.realpath(arguments[0]))
    entries = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:] = [first, *entries, *(p for p in sys.path[1:] if p not in server_entries)]
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    code = 0
    try:
        if arguments[0] == "-m":
            sys.argv = ["-m", *arguments[2:]]
            runpy._run_module_as_main(arguments[1], alter_argv=True)  # what `python -m` calls
        elif arguments[0] == "-c":
            sys.argv = ["-c", *arguments[2:]]
            exec(compile(arguments[1], "<string>", "exec"), main_module.__dict__)
        else:
            sys.argv = list(arguments)
            script = os.path.abspath(arguments[0])
            with open(script, "rb") as source:
                code_object = compile(source.read(), script, "exec")
            main_module.__file__ = script
            exec(code_object, main_module.__dict__)
    except SystemExit as ended:
        code = _exit_code(ended.code)
    except BaseException as raised:
        traceback = raised.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename == __file__:
            traceback = traceback.tb_next  # the command's frames only, as the interpreter shows them
        sys.excepthook(type(raised), raised.with_traceback(traceback), traceback)
        code = 1
    os._exit(_finish(code))


def _take_files(received: list[int], numbers: list[int]) -> None:
    """Make the client's open files this process's, under their numbers (moved out of their way first)."""
    above = max([*numbers, *received]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, number in zip(moved, numbers):
        os.dup2(fd, number)
        os.close(fd)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> int:
    """What the interpreter does at exit: join the threads that are not daemons, run the atexit handlers, flush."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


if __name__ == "__main__":
    main(sys.argv[1])
