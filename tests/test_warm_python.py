"""The tests' warm interpreter (tests/warm/python: tests/warm_client.py and tests/warm_server.py) runs a command as
the interpreter runs it, only without importing torch, Lightning and lightning_par again: the same arguments,
``sys.path``, directory, environment, standard streams and open files, exit status and traceback, and a kill of the
process the test started ends the command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from installed import PYTHON

PROBE = """\
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "variable": os.environ.get("PROBED"),
                  "stdin": sys.stdin.read(), "name": __name__, "spec": getattr(__spec__, "name", None)}))
if os.environ.get("PROBE_FD"):
    os.write(int(os.environ["PROBE_FD"]), b"written")
if os.environ.get("PROBE_RAISE"):
    raise ValueError("probed")
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


@pytest.fixture(scope="module")
def warm() -> str:
    """tests/warm/python, once the session's server listens (a client that finds none runs cold)."""
    socket = Path(os.environ["LIGHTNING_PAR_WARM_SOCKET"])
    deadline = time.monotonic() + 240
    while not socket.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert socket.exists(), "the warm server never listened: see server.log beside its socket"
    return PYTHON


def _both(arguments: list[str], warm: str, **options: object) -> tuple[subprocess.CompletedProcess, ...]:
    return tuple(subprocess.run([python, *arguments], capture_output=True, text=True, timeout=60, **options)
                 for python in (sys.executable, warm))


def test_a_warm_command_runs_as_a_cold_one(warm: str, tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    environment = {**os.environ, "PROBED": "yes", "PROBE_EXIT": "3", "PYTHONPATH": str(tmp_path)}
    for arguments in (["probe.py", "a b", "-c"], ["-m", "probe", "x"], ["-u", "-c", PROBE, "y"]):
        cold, hot = _both(arguments, warm, cwd=tmp_path, env=environment, input="given")
        assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr) == \
            (3, hot.stdout, ""), arguments
        assert json.loads(hot.stdout)["stdin"] == "given"
    cold, hot = _both(["probe.py"], warm, cwd=tmp_path, env={**environment, "PROBE_RAISE": "1"})
    assert hot.returncode == cold.returncode == 1
    assert hot.stderr == cold.stderr and hot.stderr.endswith("ValueError: probed\n"), hot.stderr


def test_a_warm_command_is_warm_and_gets_the_files_passed_to_it(warm: str) -> None:
    cold, hot = _both(["-c", "import sys; print('lightning' in sys.modules)"], warm)
    assert (cold.stdout, hot.stdout) == ("False\n", "True\n")
    read, write = os.pipe()
    try:
        subprocess.run([warm, "-c", PROBE], pass_fds=(write,), env={**os.environ, "PROBE_FD": str(write)},
                       capture_output=True, timeout=60, check=True)
        assert os.read(read, 100) == b"written"
    finally:
        os.close(read)
        os.close(write)


def test_a_warm_command_ends_as_its_process_ends(warm: str, tmp_path: Path) -> None:
    """A command killed by a signal: its process ends by the same signal. The process killed (SIGKILL, which it
    cannot pass on): the command ends too."""
    killed = subprocess.run([warm, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], timeout=60)
    assert killed.returncode == -signal.SIGKILL
    pid_file = tmp_path / "pid"
    process = subprocess.Popen([warm, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid()));"
                                "time.sleep(600)"])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    command = int(pid_file.read_text())
    process.kill()
    process.wait()
    deadline = time.monotonic() + 30
    while _alive(command) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(command)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
