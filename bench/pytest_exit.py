"""A pytest plugin (`-p bench.pytest_exit`, bench/gpu_session.py's pytest steps): once pytest is done (its
summary and junit XML written), flush and os._exit with its exit status, so no atexit hook can hang the
process: on the GPU machine inductor's shutdown_compile_workers sat at exit until the step's limit, after
`4 passed in 24.00s` (2026-11-27)."""

from __future__ import annotations

import os
import sys

import pytest

_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _status[:] = [int(exitstatus)]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if not _status:  # no session ran (--help, a usage error): pytest exits as it would
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_status[0])
