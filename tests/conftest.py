"""The test session's set-up: the server the distributed tests' workers fork from."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver


def pytest_configure(config) -> None:
    """Start the fork server with torch imported, before any test changes the environment
    or ``sys.path``: every worker of ``distributed.run_processes`` starts from its copy."""
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "accordion.ddp"])
    multiprocessing.forkserver.ensure_running()
