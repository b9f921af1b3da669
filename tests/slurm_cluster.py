"""A real Slurm on this machine, for tests: munged, slurmctld and two slurmd (emulated nodes
n1 and n2), all under one temporary directory, on free ports, without cgroups or accounting.

Debian's ``slurm-wlm`` and ``munge`` provide the daemons (``make test`` and ``.ci/run``
install them where they can). Nothing outside the temporary directory is touched: munged gets
its own key and socket, which slurm.conf names through ``AuthInfo``; client commands find the
cluster through ``SLURM_CONF``, which jobs inherit.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
DEBIAN_PACKAGES = "slurm-wlm munge"
NODES = ("n1", "n2")
CPUS_PER_NODE = 2
# A requeued job may start again only after its launch credential has expired (120 s by
# default), and then at the next pass of the main scheduling loop (every 60 s by default):
# 10 s and 1 s keep requeue tests short.
CRED_EXPIRE_S = 10


def missing_programs() -> list[str]:
    return [p for p in (*DAEMONS, *CLIENTS)
            if shutil.which(p) is None and not Path(f"/usr/sbin/{p}").exists()]


def _program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def slurm_conf(root: Path, ctld_port: int, node_ports: Mapping[str, int]) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={CPUS_PER_NODE} Boards=1 SocketsPerBoard=1 CoresPerSocket={CPUS_PER_NODE} "
        "ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN"
        for name, port in node_ports.items())
    return f"""\
ClusterName=pdefit-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait=10
MinJobAge=3600
InactiveLimit=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    processes: list[subprocess.Popen] = field(default_factory=list)

    # -- commands -------------------------------------------------------------------------------

    def run(self, *args: str, check: bool = True, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], env={**self.env, **(env or {})},
                              check=check, capture_output=True, text=True, timeout=timeout)

    def sbatch(self, script: Path | str, *args: str, options: Sequence[str] = (),
               env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit; returns the job id. Jobs inherit this environment plus ``env``."""
        done = subprocess.run(["sbatch", "--parsable", *options, str(script), *args],
                              env={**self.env, **(env or {})}, cwd=cwd, check=True,
                              capture_output=True, text=True, timeout=60)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``ExitCode``, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        fields: dict[str, str] = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_for(self, job_id: str, states: Sequence[str], timeout: float = 180,
                 ) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {list(states)} after {timeout} s: "
                                   f"{info}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    # -- lifecycle ------------------------------------------------------------------------------

    def _start(self, *args: str, log: str) -> subprocess.Popen:
        out = (self.root / "log" / log).open("w")
        process = subprocess.Popen([str(a) for a in args], env=self.env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        return process

    def stop(self, timeout: float = 30) -> None:
        """Cancel every job, give them time to end (they need munged to do so), then stop the
        daemons."""
        if shutil.which("scancel"):
            self.run("scancel", "--full", "--user=root", check=False, timeout=20)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.run(
                    "squeue", "-h", check=False, timeout=20).stdout.strip():
                time.sleep(0.2)
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def start_cluster(root: Path, nodes: Sequence[str] = NODES, timeout: float = 60,
                  ) -> SlurmCluster:
    """Start munged, slurmctld and one slurmd per node; return once every node is idle."""
    for sub in ("munge", "state", "spool", "run", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for node in nodes:
        (root / "spool" / node).mkdir(exist_ok=True)
    root.chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ctld_port, *node_ports = _free_ports(1 + len(nodes))
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, ctld_port, dict(zip(nodes, node_ports, strict=True))))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(root, env)
    try:
        cluster._start(_program("munged"), "--foreground", "--force",
                       f"--socket={root}/munge/munge.socket", f"--key-file={key}",
                       f"--pid-file={root}/run/munged.pid", f"--seed-file={root}/munge/seed",
                       f"--log-file={root}/log/munged.log", log="munged.out")
        _wait(lambda: (root / "munge" / "munge.socket").exists(), timeout, "munged", cluster)
        cluster._start(_program("slurmctld"), "-D", "-i", log="slurmctld.out")
        _wait(lambda: "UP" in cluster.run("scontrol", "ping", check=False).stdout, timeout,
              "slurmctld", cluster)
        for node in nodes:
            cluster._start(_program("slurmd"), "-D", "-N", node, log=f"slurmd-{node}.out")

        def idle() -> bool:
            out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            return all(states.get(node) == "idle" for node in nodes)

        _wait(idle, timeout, "slurmd", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for process in cluster.processes:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with {process.returncode}:\n{cluster.logs()}"
                                   + _outs(cluster))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout} s:\n{cluster.logs()}"
                               + _outs(cluster))
        time.sleep(0.1)


def _outs(cluster: SlurmCluster) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}"
                   for p in sorted((cluster.root / "log").glob("*.out")))
