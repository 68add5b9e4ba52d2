"""A real `neffkit run` server for the e2e tests, and the tiny bundle it serves."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from tests.support import REPO
from tests.support.bundles import build_session_bundle, prebuild
from tests.support.models import CHAT_TEMPLATE

# decode buckets up to 8, so 16 concurrent streams exercise batching and queueing (a single
# stream decodes in the bucket of 4); every graph is the server's own (its sampler takes
# structured outputs, penalties, logit bias and prompt logprobs)
SERVE_BUCKETS = {"prefill": [16], "decode": [4, 8], "context": [64]}
# the test models' chat template with a tools section of one token (--chat-template): the
# template without one would get the tools written into the prompt (serve/tool_prompt.py),
# longer than the tiny bundles' context
TOOLS_TEMPLATE = "{% if tools %}#{% endif %}" + CHAT_TEMPLATE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, bundle: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # files, not pipes: the access log writes a line per request, and a pipe nobody reads
        # while the server runs would fill and block it
        self.logs = Path(tempfile.mkdtemp(prefix="neffkit-server-"))
        with (self.logs / "out").open("w") as out, (self.logs / "err").open("w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "neffkit",
                    "run",
                    str(bundle),
                    "--port",
                    str(self.port),
                    *args,
                ],
                cwd=REPO,
                stdout=out,
                stderr=err,
                text=True,
                env=env,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.stderr()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("server did not become healthy")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"), **kw)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def stdout(self) -> str:
        return (self.logs / "out").read_text()

    def stderr(self) -> str:
        return (self.logs / "err").read_text()

    def stop(self) -> None:
        """SIGTERM: the server stops its engine core and exits 0 (as under systemd)."""
        self.proc.terminate()
        assert self.proc.wait(timeout=30) == 0, self.stderr()
        shutil.rmtree(self.logs, ignore_errors=True)


@prebuild("llama_serve", stage=1)
def build_serve_bundle(session_dir: Path, hf_model_dir) -> Path:
    return build_session_bundle(
        session_dir,
        hf_model_dir("llama"),
        "llama_serve",
        buckets=SERVE_BUCKETS,
        kv_cache={"block_size": 16, "num_blocks": 17},
        sampling={"max_top_k": 16, "prompt_logprobs": True},
    ).bundle
