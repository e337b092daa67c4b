"""A Python command started warm: run by tests/warm/python in place of the interpreter, it has the warm server
(tests/warm_server.py) fork the command from a process that has imported torch, Lightning and lightning_par already,
and stands for it until it ends: same standard streams and open files, same environment and directory, signals
passed on, its exit status as its own. A kill this process cannot catch (SIGKILL) ends the command too, as the
server sees the connection close. Without a server, or for an option it does not take, it runs the interpreter
itself (cold).

Standard library only, and run with ``python -S``: it starts in milliseconds.
"""

import array
import json
import os
import signal
import socket
import struct
import sys

SOCKET_VARIABLE = "LIGHTNING_PAR_WARM_SOCKET"
PYTHON_VARIABLE = "LIGHTNING_PAR_TEST_PYTHON"


def _cold(arguments):
    python = os.environ[PYTHON_VARIABLE]
    os.execv(python, [python, *arguments])


def _takes(arguments):
    """Whether a warm start runs ``arguments`` as the interpreter would: ``[-u] (-m module | -c code | script) ...``."""
    rest = arguments[1:] if arguments[:1] == ["-u"] else arguments
    if not rest:
        return False
    return len(rest) > 1 if rest[0] in ("-m", "-c") else not rest[0].startswith("-")


def _open_files(exclude):
    found = []
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
        try:
            os.fstat(fd)  # the listing's own descriptor is closed by now
        except OSError:
            continue
        if fd != exclude:
            found.append(fd)
    return found


def main():
    arguments = sys.argv[1:]
    path = os.environ.get(SOCKET_VARIABLE)
    if not path or not _takes(arguments):
        _cold(arguments)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:  # the server is still importing, or gone
        connection.close()
        _cold(arguments)
    files = _open_files(connection.fileno())
    request = json.dumps({"argv": arguments, "cwd": os.getcwd(), "env": dict(os.environ), "fds": files,
                          "executable": sys.argv[0]}).encode()
    connection.sendmsg([struct.pack("!I", len(request)), request],
                       [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", files))])

    def pass_on(number, frame):
        connection.sendall(struct.pack("!i", number))

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, pass_on)
    reply = b""
    while len(reply) < 4:
        try:
            chunk = connection.recv(4 - len(reply))
        except InterruptedError:
            continue
        if not chunk:
            os.kill(os.getpid(), signal.SIGKILL)  # the server died under the command: nothing to report
        reply += chunk
    status = struct.unpack("!i", reply)[0]
    if status < 0:  # ended by a signal: end by the same one
        if -status not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


if __name__ == "__main__":
    main()
