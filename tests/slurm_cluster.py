"""A real two-node SLURM cluster on this machine, for tests: munge, slurmctld and two slurmd daemons.

Debian's slurmd is built with multiple-slurmd support, so ``slurmd -N node1`` and ``slurmd -N node2``
on one machine are two nodes to the controller (../shared/notes/slurm-on-one-machine.md). No cgroups, no
accounting; every file (state, spool, logs, pid files, the munge key and socket) lives in one temporary
directory, and the daemons are stopped by the PIDs in their pid files.

``cluster()`` is a context manager yielding the environment client commands need (``SLURM_CONF``); it
raises ``ClusterUnavailable`` with the reason when the packages are missing (a reason to skip), and
``RuntimeError`` when the daemons do not come up (a failure).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from harness import free_port

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "sinfo")
NODES = ("node1", "node2")
CPUS_PER_NODE = 2


class ClusterUnavailable(RuntimeError):
    pass


def _slurm_conf(root: Path, socket: Path) -> str:
    ctld_port, node_port = free_port(), free_port()
    while node_port + 1 == ctld_port:
        node_port = free_port()
    return f"""\
ClusterName=lightningpar
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={socket},cred_expire=5
CredType=cred/munge
SlurmUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=2
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=2
NodeName=node[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{node_port}-{node_port + 1}] CPUs={CPUS_PER_NODE} State=UNKNOWN
PartitionName=lightningpar Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def cluster() -> Iterator[dict[str, str]]:
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        raise ClusterUnavailable(f"SLURM is not installed ({', '.join(missing)} missing; apt-get install slurmctld "
                                 "slurmd slurm-client munge)")
    if os.geteuid() != 0:
        raise ClusterUnavailable("starting munged and slurmd needs root")
    # Not under pytest's tmp_path: its directories are private to root, and munged runs as the munge user.
    root = Path(tempfile.mkdtemp(prefix="lightning-par-slurm-"))
    root.chmod(0o755)
    munge = root / "munge"
    munge.mkdir()
    (root / "state").mkdir()
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    subprocess.run(["chown", "-R", "munge:munge", str(munge)], check=True)
    munge.chmod(0o755)  # munged refuses a socket directory others can write to, clients need to reach it
    key.chmod(0o400)
    socket = munge / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, socket))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pid_files = [munge / "munged.pid", root / "slurmctld.pid", *(root / f"slurmd-{node}.pid" for node in NODES)]
    try:
        _start(["runuser", "-u", "munge", "--", "munged", f"--socket={socket}", f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munge.seed'}"], env)
        _start(["slurmctld", "-f", str(conf)], env)
        for node in NODES:
            _start(["slurmd", "-f", str(conf), "-N", node], env)
        _wait_for_idle_nodes(env, root)
        yield env
    finally:
        subprocess.run(["scancel", "--partition=lightningpar"], env=env, capture_output=True)
        _stop(pid_files)
        shutil.rmtree(root, ignore_errors=True)


def _start(command: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0] if command[0] != 'runuser' else 'munged'} did not start: "
                                 f"{result.stderr.strip() or result.stdout.strip()}")


def _wait_for_idle_nodes(env: dict[str, str], root: Path, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    states = ""
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True,
                                text=True).stdout
        if states.count("idle") == len(NODES):
            return
        time.sleep(0.5)
    log = (root / "slurmctld.log").read_text()[-2000:] if (root / "slurmctld.log").exists() else ""
    raise RuntimeError(f"the nodes did not become idle within {seconds:.0f} s: {states!r}\n{log}")


def _stop(pid_files: list[Path], seconds: float = 5.0) -> None:
    """SIGTERM every daemon named in ``pid_files``, SIGKILL those still there after ``seconds``."""
    pids = []
    for pid_file in pid_files:
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(pid_file.read_text().strip()))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + seconds
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def job_state(job_id: str, env: dict[str, str]) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
    text = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)
