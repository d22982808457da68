"""The test session's set-up: the server the distributed tests' workers fork from, and one
MNIST-1D cache for every process the session starts."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import tempfile

_CACHE = "ACCORDION_CACHE"


def pytest_configure(config) -> None:
    """Start the fork server with torch imported, before any test changes the environment
    or ``sys.path``: every worker of ``distributed.run_processes`` starts from its copy.

    Generating MNIST-1D costs about 10 s per process; the subprocesses the tests launch
    (torchrun, the CLI) inherit one session-wide cache folder instead, unless the caller
    named one. Tests of the uncached path remove the variable themselves.
    """
    if _CACHE not in os.environ:
        folder = tempfile.mkdtemp(prefix="accordion-test-cache-")
        os.environ[_CACHE] = folder
        config._accordion_cache = folder
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "accordion.ddp"])
    multiprocessing.forkserver.ensure_running()


def pytest_unconfigure(config) -> None:
    """Remove the session's cache folder, if the session made it."""
    folder = getattr(config, "_accordion_cache", None)
    if folder is not None:
        os.environ.pop(_CACHE, None)
        shutil.rmtree(folder, ignore_errors=True)
