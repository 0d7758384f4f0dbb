"""The agent of `--nproc N`: PyTorch's elastic agent (the engine torchrun runs), started in a process
forked from the launcher (launch.py), that starts the N ranks as forks of itself.

Each rank is a new process that begins with torch, torch._dynamo and the command's own modules
imported, and nothing else: the launcher imported them (PRELOAD, and what its caller imported)
before forking, and never built a model, ran an operator or drew a random number (the lab's warm
starts rest on the same fact). A rank started cold would import them again: seconds of CPU per rank
before its first step, on every launch.

The agent is torchrun's `--standalone`: one node, a c10d rendezvous on a free local port, no
restarts. Each rank runs the command it is given, `main(ARGV)` (the CLI's, handed down by its
caller: this layer sits below it), as a rank torchrun started would (RANK, WORLD_SIZE, MASTER_ADDR
... in its environment), and exits with its code.

Under `exactresume doctor`, whose tracer runs in the launcher, the ranks are spawned instead: each
is a fresh Python, traced by the doctor as a process of its own.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

# What every rank needs of torch before its first step; imported by the launcher, so that each fork has it.
PRELOAD = ("torch._dynamo", "torch.distributed.launcher.api")
TRACED = "EXACTRESUME_DOCTOR_TRACE"  # set where the doctor's tracer runs (doctor/tracer/shim)
# The ranks meet at a store of their own, hosted by rank 0, not at the agent's: a rank forked while one of
# the agent's store threads looked up the address of a rank connecting to it (torch formats each peer's
# address with getnameinfo) inherits glibc's resolver lock held, and its own first connect waits for ever
# (seen: a rank in __resolv_context_get under TCPStore's connect, 3 suite runs in 16, the agent's address
# numeric). With no rank connecting to the agent, its threads look nothing up while it forks.
OWN_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def preload() -> None:
    """Import PRELOAD in this process (the launcher), before it forks the agent."""
    for module in PRELOAD:
        importlib.import_module(module)


def run_agent(main: Callable[[list[str]], int], argv: Sequence[str], nproc: int, files: Path) -> int:
    """Run `main(ARGV)` on N ranks of this machine under the elastic agent; the first failed rank's
    exit code (128 + N for a signal), 0 when every rank succeeded. `main` is a module's function
    (spawned ranks unpickle it by name). `files`: an empty folder for the agent's files for its ranks,
    removed here once they have ended and by its caller, whichever outlives the other (left to itself,
    the agent makes a folder in the temp folder on every launch, and a file for each rank that raised,
    one whose peer died, and leaves them)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    tempfile.tempdir = str(files)  # this process is the agent alone; each rank finds its own again (_run_rank)
    os.environ[OWN_STORE] = "1"
    try:
        elastic_launch(agent_config(nproc, files), _run_rank)(main, list(argv))
    except ChildFailedError as failed:
        code = failed.get_first_failure()[1].exitcode
        return code if code >= 0 else 128 - code
    except SignalException as signalled:
        return 128 + signalled.sigval
    finally:
        tempfile.tempdir = None
        shutil.rmtree(files, ignore_errors=True)
    return 0


def agent_config(nproc: int, files: Path):
    """torchrun's `--standalone --nproc-per-node N` as the agent's config, its ranks forked, its files in `files`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        local_addr="127.0.0.1",  # rank 0's store at an address no rank has to look up
        max_restarts=0,
        logs_specs=DefaultLogsSpecs(log_dir=str(files)),
        start_method="spawn" if os.environ.get(TRACED) else "fork",
    )


def _run_rank(main: Callable[[list[str]], int], argv: list[str]) -> None:
    """One rank: `main(ARGV)` in this process; a failure leaves with its command's exit code."""
    # A fork has the agent's handlers (they raise into the agent's loop): a rank starts with the defaults.
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tempfile.tempdir = None  # the agent's is its own folder for its files
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)
