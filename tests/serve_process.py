"""Test support: the `minillm serve` command in a process of its own, on a free port of 127.0.0.1."""
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

from minillm.hardware.collectives import free_port


@contextmanager
def serve_process(model_path, *flags, kv_cache_bytes: int = 32 << 20, startup_timeout: float = 300.0,
                  cwd=None, env=None):
    """Yields (process, base url) once /health answers; stdout and stderr are one text pipe. ``cwd``
    and ``env``: another checkout's (a copy with the exercises solved)."""
    port = free_port()
    command = [sys.executable, "-m", "minillm.cli", "serve", "--model", str(model_path), "--port", str(port),
               "--kv-cache-bytes", str(kv_cache_bytes), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
