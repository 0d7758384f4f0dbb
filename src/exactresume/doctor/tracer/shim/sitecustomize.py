"""Put first on a child's PYTHONPATH by `exactresume doctor`: starts its tracer before the script runs.

The tracer package is loaded from this folder's files under a private name, so the child needs
neither exactresume on its path nor anything of ours beyond these files. A `sitecustomize` that the
environment had before ours is still imported afterwards. When the tracer cannot start in this
Python (no torch, say), the process says why and ends before the script runs (the package's
`not_started`): the doctor reads the reason and says it in one line.
"""

import importlib.machinery
import importlib.util
import os
import sys

_NAME = "_exactresume_doctor_tracer"


def _start() -> None:
    folder = os.environ.get("EXACTRESUME_DOCTOR_TRACER_DIR")
    if not folder or not os.environ.get("EXACTRESUME_DOCTOR_TRACE"):
        return
    try:
        spec = importlib.util.spec_from_file_location(
            _NAME, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = package
        spec.loader.exec_module(package)
    except Exception as error:  # the package's first lines: only a Python too old for them fails here
        sys.stderr.write(f"exactresume doctor: the tracer could not start in {sys.executable}: {error!r}\n")
        os._exit(88)  # NOT_STARTED, which the package that failed would have given
    try:
        importlib.import_module(_NAME + ".install").start_from_environment()
    except Exception as error:
        package.not_started(error)


def _chain() -> None:
    """Import the sitecustomize this one shadows, if the environment has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_start()
_chain()
