"""Custom reward functions used by the reward-pool tests (imported by dotted path inside the
reward worker processes; not a test module)."""
import os
import sys
import time


def length_bonus(completion, answer, *, prompt="", metadata=None, scale=1.0):
    return scale * min(len(completion), 10) / 10


def uses_metadata(completion, answer, *, prompt="", metadata=None):
    return float(metadata["bonus"]) if metadata else -1.0


def hang(completion, answer, **kwargs):
    if completion == "hang":
        while True:
            time.sleep(0.05)
    return 1.0


def boom(completion, answer, **kwargs):
    raise RuntimeError(f"verifier bug on {completion!r}")


def exit_call(completion, answer, **kwargs):
    sys.exit(3)


def hard_crash(completion, answer, **kwargs):
    if completion == "crash":
        os._exit(7)
    return 0.5


def stop_request_then_score(completion, answer, **kwargs):
    """SLURM's SIGUSR1 stop request reaches every process of the job step, reward workers included."""
    import signal

    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.2)
    return 0.75


def not_a_number(completion, answer, **kwargs):
    return float("nan")


NOT_CALLABLE = 3


def value_of_completion(completion, answer, **kwargs):
    """The completion text as the reward value ("nan", "inf", "1e30", ...)."""
    return float(completion)


def allocate_mib(completion, answer, **kwargs):
    """Allocate (and touch) int(completion) MiB; 1.0 when that worked."""
    block = bytearray(int(completion) * 2**20)
    block[::4096] = b"x" * len(block[::4096])
    return 1.0


def hang_and_record_pid(completion, answer, *, metadata=None, **kwargs):
    """Write this worker's pid to metadata["pid_file"], then never return."""
    with open(metadata["pid_file"], "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)
