"""Servers the tests start (JupyterLab): a free port, a process whose output goes to a
log file (a pipe nobody reads would fill up and stall it), waiting until it answers,
and stopping it whatever happens."""

import contextlib
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(command: list, *, ready_url: str, log: Path, env: dict, cwd=None,
            timeout_s: float = 120) -> Iterator[subprocess.Popen]:
    """Run ``command`` until the block ends; the block starts once ``ready_url`` answers."""
    with open(log, "w", encoding="utf-8") as output:
        server = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    urllib.request.urlopen(ready_url, timeout=2).close()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{command[0]} did not start:\n{log.read_text()}") from None
                    time.sleep(0.5)
            yield server
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
