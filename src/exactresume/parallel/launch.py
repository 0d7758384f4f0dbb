"""`--nproc N`: start the same command in N processes through PyTorch's own elastic agent (the
engine torchrun runs), the ranks forked from this process (agent.py).

    exactresume train ... --nproc 2
    = torchrun --standalone --nproc-per-node 2 -m exactresume -- train ... --nproc 2,
      each rank a fork that starts with torch imported

This process imports what the ranks need (agent.PRELOAD; its caller imported the command's own
modules), then forks the agent, which forks the ranks, each running the command's `main(ARGV)`.
Each rank finds its rank in the environment the agent sets (world.World.from_env) and ignores
--nproc. A user's mistake is met by every rank alike; the launcher prints it once, as one line, with
the rank's exit code (2, or 74 for a disk that refused a write), instead of the agent's failure
report.

Preemption: the agent runs in its own session, and a SIGTERM or SIGINT to this process is passed on
to it, as is a SIGTERM when this process dies (kill -9 included); the agent passes it to every rank
once, the ranks agree to stop after the same step, save, and exit 75, which the launcher returns. A
signal sent to every process at once (the ranks included, as some schedulers do) reaches the ranks
twice, and a second signal stops a rank without saving.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from exactresume.errors import UserError
from exactresume.parallel.agent import preload, run_agent

# The line every rank prints for a user's mistake or an interrupt (cli.main).
ERROR_LINE = re.compile(r"^exactresume \w+: (error: .*|interrupted|stopped by .* after step \d+.*)$")
PREEMPTED_EXIT = 75  # preemption.PREEMPTED_EXIT (that module is not imported here)
# DDP's note that find_unused_parameters found none: we set it on purpose (replicas.Replicas).
EXPECTED_NOTE = "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"


def first_error(stderr: str) -> str | None:
    """The first of the ranks' one-line errors in the launcher's stderr, if any rank printed one."""
    return next((line for line in stderr.splitlines() if ERROR_LINE.match(line)), None)


# The agent's report of a rank that ended: its exit code (negative: the signal that ended it), rank and pid.
RANK_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
# What a rank's collective says when the rank at the other end of its connection is gone.
PEER_GONE = re.compile(r"Connection (?:reset|closed) by peer")
AFTER = "and the other ranks were stopped; the checkpoints already written are intact: rerun with --resume auto"


def _killed_rank(stderr: str, command: str, agent_code: int) -> tuple[str, int] | None:
    """Where a rank was ended from outside and printed nothing (kill -9, the out-of-memory killer): our one
    line for it, and the exit code (a shell's for the signal, when the agent saw it); None otherwise. The
    agent reports the first rank it saw fail, which may be one whose peer had vanished."""
    said = f"exactresume {command}: error:"
    for code, rank, pid in RANK_FAILED.findall(stderr):
        if int(code) < 0:
            name = signal.Signals(-int(code)).name
            how = f"was ended by {name} (a kill, or the out-of-memory killer)"
            return f"{said} rank {rank} (pid {pid}) {how}, {AFTER}", 128 - int(code)
    if PEER_GONE.search(stderr):
        how = "was ended from outside (a kill, or the out-of-memory killer: its peers lost their connection to it)"
        return f"{said} a rank {how}, {AFTER}", agent_code
    return None


def launch(main: Callable[[list[str]], int], argv: Collection[str], nproc: int) -> int:
    """Run the command `main(ARGV)` in N processes; a rank's one line and exit code when one fails."""
    if not hasattr(os, "fork"):
        raise UserError("--nproc needs a system with fork (Linux, macOS); start torchrun yourself here")
    preload()
    sys.stdout.flush()  # else the agent and every rank would print what is still buffered here
    sys.stderr.flush()
    launcher, (read_end, write_end) = os.getpid(), os.pipe()
    # The agent's files for its ranks: the agent removes them, and this process once it has ended, killed too
    with tempfile.TemporaryDirectory(prefix="exactresume-ranks-", ignore_cleanup_errors=True) as files:
        agent = os.fork()
        if agent == 0:
            os.close(read_end)
            _be_the_agent(main, argv, nproc, write_end, launcher, Path(files))
        os.close(write_end)
        with _passing_signals_to(agent), os.fdopen(read_end, errors="replace") as agent_stderr:
            stderr = agent_stderr.read()  # the agent's and the ranks' stderr, until the last of them ends
            code = os.waitstatus_to_exitcode(os.waitpid(agent, 0)[1])
    error = first_error(stderr) if code else None
    killed = _killed_rank(stderr, next(iter(argv), ""), code) if code and error is None else None
    if killed is not None:  # the agent's log of it is torch's report, not the user's: one line instead
        print(killed[0], file=sys.stderr)
        return killed[1]
    if error is None:
        sys.stderr.writelines(line for line in stderr.splitlines(keepends=True) if EXPECTED_NOTE not in line)
        return code
    print(error, file=sys.stderr)
    return exit_code(error, code)


def _be_the_agent(
    main: Callable, argv: Collection[str], nproc: int, stderr_fd: int, launcher: int, files: Path
) -> None:
    """In the forked agent: its own session (a terminal's Ctrl-C reaches the ranks once, through the
    agent, not twice), SIGTERM when the launcher dies (kill -9 included: the ranks save and stop, none
    is left behind), stderr to the launcher's pipe; run the ranks, exit with the code. Never returns."""
    code = 1
    try:
        os.setsid()
        _terminated_with_parent()
        if os.getppid() != launcher:  # it died before the line above
            os._exit(128 + signal.SIGTERM)
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # the descriptors, where a caller redirected them
        # torchrun would set 1 and warn; split this machine's cores between the processes instead.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        code = run_agent(main, argv, nproc, files)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _terminated_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_code(line: str, agent_code: int) -> int:
    """The exit code a single process would have returned for the ranks' `line` (the agent's code is
    the first failed rank's)."""
    if line.endswith("interrupted"):
        return 130
    if ": stopped by " in line:
        return PREEMPTED_EXIT
    return 74 if agent_code == 74 else 2


@contextlib.contextmanager
def _passing_signals_to(pid: int) -> Iterator[None]:
    """Pass SIGTERM and SIGINT on to process `pid` (the agent) while it runs, instead of dying first."""
    numbers = (signal.SIGTERM, signal.SIGINT)
    previous = {number: signal.signal(number, lambda number, frame: os.kill(pid, number)) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
