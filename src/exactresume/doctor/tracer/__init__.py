"""The tracer `exactresume doctor` injects into a user's training process at interpreter start.

It is loaded from its files under a private package name (see `shim/sitecustomize.py`), imports only
the standard library and torch (xxhash where it is importable, numpy once the script has loaded it),
and does nothing unless `EXACTRESUME_DOCTOR_TRACE` names the folder its trace goes to.
`hooks.Tracer` holds the hooks; `fingerprint` hashes tensors and RNG states; `live` finds the
stateful objects a checkpoint should hold; `order` the sampler that draws a DataLoader's order;
`files` every path a process writes. The exit codes below are here, without torch, for the doctor,
which reads them before it imports torch.
"""

import json
import os
import sys

CUT = 86  # the process was cut after LIMIT steps, as asked
CRASH = 87  # the process was ended as a crash would end it, right after its checkpoint
NOT_STARTED = 88  # the tracer could not start in this Python: the process ended before the script ran


def not_started(error: BaseException) -> None:
    """Report why the tracer could not start (a `failed-PID.json` in the trace folder, and a line on
    stderr), then end the process before the script runs: untraced, it would run past the doctor's cut
    and write files the doctor could not put back. Never returns."""
    reason = str(error) if isinstance(error, ImportError) and str(error) else f"{type(error).__name__}: {error}"
    try:
        folder = os.environ["EXACTRESUME_DOCTOR_TRACE"]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"failed-{os.getpid()}.json"), "w") as report:
            json.dump({"python": sys.executable, "error": reason}, report)
    finally:
        sys.stderr.write(f"exactresume doctor: the tracer could not start in {sys.executable}: {reason}\n")
        sys.stderr.flush()
        os._exit(NOT_STARTED)
