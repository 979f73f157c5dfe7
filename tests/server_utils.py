"""Start a real `vllm serve` process on loopback and stop it cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from helpers import all_cores

VLLM = str(Path(sys.executable).with_name("vllm"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *args: str, log: Path, timeout: float | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [VLLM, "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "1024",
               *args]
        parallel = env is not None and "VLLM_CPU_OMP_THREADS_BIND" in env  # a core per rank or engine
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        with all_cores() if parallel else contextlib.nullcontext():
            self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        if timeout is None:  # Model Runner V2 on CPU runs its kernels in Triton's interpreter
            timeout = 600 if os.environ.get("KVC_TEST_RUNNER") == "mrv2" else 240
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"vllm serve did not become healthy:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        """SIGINT like Ctrl-C; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
