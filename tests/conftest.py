"""Suite-wide checks: no shared-memory segment is left in /dev/shm, and no launcher (in this process,
an xdist worker or a `moe-compile train` subprocess) had to remove segments the runtime should have
freed itself. The launcher's own cleanup would hide such a leak from the /dev/shm check, so it
reports what it removed to the file $MOE_COMPILE_SHM_CLEANUP_LOG names (set here, inherited by every
process the suite starts); tests that expect a removal take the report themselves (``cleaned=``)."""

from __future__ import annotations

import os
import tempfile

from moe_compile.runtime.launcher import CLEANUP_LOG_ENV

_OWN_LOG: list[str] = []
# Segments already in /dev/shm when the suite starts (another run on the same host, or one killed before
# its cleanup) are not this suite's leaks; only segments that appear while it runs are reported.
_BEFORE: set[str] = set()


def _segments() -> set[str]:
    if not os.path.isdir("/dev/shm"):
        return set()
    return {f for f in os.listdir("/dev/shm") if f.startswith("moe_compile_")}


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        _BEFORE.update(_segments())
    if hasattr(config, "workerinput") or os.environ.get(CLEANUP_LOG_ENV):
        return  # an xdist worker inherits the controller's log
    fd, path = tempfile.mkstemp(prefix="moe_compile_shm_cleanup_", suffix=".log")
    os.close(fd)
    os.environ[CLEANUP_LOG_ENV] = path
    _OWN_LOG.append(path)


def pytest_collection_modifyitems(session, config, items):
    # Longest first: with -n 2 the workers take tests in collection order, and a test of minutes left to
    # the end kept one worker busy while the other stood idle. Stable, and the same order on every worker.
    # @pytest.mark.long(minutes): the longest of them first
    def minutes(item) -> float:
        mark = item.get_closest_marker("long")
        return -(mark.args[0] if mark is not None and mark.args else 1 if mark is not None else 0)

    items.sort(key=minutes)


def pytest_sessionfinish(session, exitstatus):
    # Only the controlling process (not an xdist worker) sees the whole suite finished.
    if hasattr(session.config, "workerinput"):
        return
    if _OWN_LOG:
        path = _OWN_LOG.pop()
        with open(path) as f:
            removed = f.read().splitlines()
        os.unlink(path)
        os.environ.pop(CLEANUP_LOG_ENV, None)
        if removed:
            print(f"\nshared-memory segments the launcher had to remove (job, function, segment): {removed}")
            session.exitstatus = 1
    if _BEFORE:
        print(f"\nshared-memory segments that were there before the suite (not counted): {sorted(_BEFORE)}")
    left = sorted(_segments() - _BEFORE)
    if left:
        print(f"\nshared-memory segments left behind by the suite: {left}")
        session.exitstatus = 1
