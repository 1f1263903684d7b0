"""A real one-node Slurm cluster (munged + slurmctld + slurmd) started by the tests, for the tests.

Everything lives in a fresh temporary folder: the munge key and socket, slurm.conf, state and
spool folders and the daemons' logs. The configuration fits a container without systemd or
cgroups: `proctrack/linuxproc`, `task/none`, no accounting, one node `localhost` with the
machine's CPUs, free TCP ports picked at start. `AuthInfo=cred_expire=5` shortens the delay
Slurm puts before a requeued job may start again (default 120 s, taken from the credential
lifetime), and a 1 s scheduler interval starts it promptly.

The daemons run in the foreground as our own child processes; `stop()` cancels every job, waits
for them to leave, then ends the daemons by pid. Commands (`sbatch`, `squeue`, ...) get the
cluster through `SLURM_CONF` in `env()`.
"""
from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
INSTALL_SCRIPT = Path(__file__).resolve().parents[3] / ".ci" / "install_slurm.sh"


def missing_binaries() -> list[str]:
    return [b for b in DAEMONS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def ensure_installed() -> str | None:
    """Install Slurm + munge with .ci/install_slurm.sh if missing; return why not, or None if usable."""
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps as the submitting user; run the Slurm tests as root"
    if missing_binaries() and INSTALL_SCRIPT.is_file() and shutil.which("apt-get"):
        subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, timeout=600)
    missing = missing_binaries()
    if missing:
        return (f"Slurm/munge binaries not installed ({', '.join(missing)}) and {INSTALL_SCRIPT.name} "
                f"could not install them (needs Debian's slurmctld slurmd slurm-client munge packages)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def job_id_with_free_rendezvous_ports(count: int = 20) -> int:
    """A first job id whose train.sbatch ports (15000 + id % 15000) are free for `count` jobs.

    Random, so that test sessions running side by side on one machine (each with its own cluster
    numbering jobs from 1) do not share a rendezvous port and join each other's jobs.
    """
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(1, 15000 - count)
        if all(_port_is_free(15000 + first + i) for i in range(count)):
            return first
    raise SlurmError("no free range of rendezvous ports in 15000-29999")


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _detach_but_die_with_parent() -> None:
    """In the daemon's child process: own session (a terminal's Ctrl-C goes to pytest, which stops
    the cluster in order), and SIGTERM if pytest itself dies, so that no daemon outlives a test run."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG (Linux)


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    def __init__(self, cpus: int | None = None):
        self.cpus = cpus or os.cpu_count() or 1
        self.root = Path(tempfile.mkdtemp(prefix="slurm-"))  # short: unix socket paths are <= 107 bytes
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 60) -> SlurmCluster:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(mode=0o700)
        r.chmod(0o755)  # munged wants the socket's folders searchable by everyone
        (r / "munge").chmod(0o755)
        subprocess.run([_sbin("mungekey"), "-c", "-k", str(r / "munge/munge.key")], check=True,
                       capture_output=True)
        self.conf.write_text(self._slurm_conf())
        self._spawn("munged", [_sbin("munged"), "-F", "-f", f"--key-file={r}/munge/munge.key",
                               f"--socket={r}/munge/munge.socket", f"--pid-file={r}/munge/munged.pid",
                               f"--log-file={r}/munge/munged.log", f"--seed-file={r}/munge/munged.seed"])
        self._wait(lambda: (r / "munge/munge.socket").exists(), 10, "munged did not create its socket")
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_sbin("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf)])
        self._wait(self._node_idle, timeout, "the node did not become idle")
        return self

    def stop(self) -> None:
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                self.run(["scancel", "--user", "root"], check=False)
                self._wait(lambda: not self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip(),
                           60, None)
        finally:
            for name in ("slurmd", "slurmctld", "munged"):
                p = self.procs.get(name)
                if p is None or p.poll() is not None:
                    continue
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ commands
    def env(self, **extra: str) -> dict[str, str]:
        """The caller's environment minus any outer Slurm job's variables, plus SLURM_CONF."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def run(self, cmd: list[str], *, check: bool = True, cwd=None, env=None, timeout: float = 60):
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env or self.env(), timeout=timeout)
        if check and res.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}\n{self.daemon_logs()}")
        return res

    def sbatch(self, args: list[str], *, cwd, env=None) -> int:
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, StdOut, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_job(self, job_id: int, states=("COMPLETED",), timeout: float = 120, poll: float = 0.5) -> dict:
        """Wait until the job is in one of `states`; fail early on a final state not asked for."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
        deadline = time.monotonic() + timeout
        info = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            state = info.get("JobState")
            if state in states:
                return info
            if state in final:
                raise SlurmError(f"job {job_id} ended {state} (waiting for {states}): {info}\n{self.daemon_logs()}")
            time.sleep(poll)
        raise SlurmError(f"job {job_id} not in {states} after {timeout} s: {info}\n{self.daemon_logs()}")

    def start_now(self, job_id: int) -> None:
        """Let a pending (e.g. just requeued) job start without waiting for its begin time."""
        self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)

    def daemon_logs(self, tail: int = 30) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # ------------------------------------------------------------------ internals
    def _slurm_conf(self) -> str:
        r = self.root
        return f"""\
ClusterName=pytest
FirstJobId={job_id_with_free_rendezvous_ports()}
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket,cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=30
NodeName=localhost CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.root / "log" / f"{name}.stdout", "w") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                                preexec_fn=_detach_but_die_with_parent)

    def _node_idle(self) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                out = (self.root / "log" / f"{name}.stdout").read_text(errors="replace")
                raise SlurmError(f"{name} exited with {p.returncode}: {out}\n{self.daemon_logs()}")
        res = self.run(["sinfo", "-h", "-o", "%t"], check=False)
        return res.returncode == 0 and res.stdout.strip() == "idle"

    @staticmethod
    def _wait(cond, timeout: float, message: str | None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.3)
        if message:
            raise SlurmError(message)
