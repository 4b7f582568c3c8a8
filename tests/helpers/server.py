"""Server-test helpers: a real `python -m kda_rt.serve` subprocess on a free loopback port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

__all__ = ["API_KEY", "MAX_MODEL_LEN", "ServerProc", "free_port", "parse_metrics", "pid_gone"]

API_KEY = "sk-kda-rt-test"
MAX_MODEL_LEN = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """One server subprocess; its stdout+stderr go to `log_path`."""

    def __init__(self, log_path: Path, *extra: str, api_key: str | None = API_KEY,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cmd = [sys.executable, "-m", "kda_rt.serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend", "numpy", "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "info", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=None if env is None else {**os.environ, **env})
        self.engine_pid = self._wait_healthy()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def _wait_healthy(self, timeout: float = 90.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2.0)
                if r.status_code == 200:
                    return r.json()["engine_pid"]
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics keyed `name` or `name{a="x",b="y"}` (labels sorted, `model_name` left out)."""
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10.0).text)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        if "{" in key:
            name, labels = key[:-1].split("{", 1)
            pairs = sorted(p for p in re.findall(r'[a-zA-Z_]+="[^"]*"', labels) if not p.startswith("model_name="))
            key = name + ("{" + ",".join(pairs) + "}" if pairs else "")
        out[key] = float(value)
    return out


def pid_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return True  # a zombie: exited, waiting for its (gone) parent's reaper
        time.sleep(0.05)
    return False
