"""10,000 generated requests against a live server (tools/fuzz_server.py): plausible and hostile
values for every field the API takes (huge, negative, non-finite, nested past a parser's depth,
truncated JSON, too many or too long stop strings, grammars that do not compile), both routes,
streamed and not. No answer may be a 5xx, every 4xx carries an OpenAI error body, and the server
answers /health and the same greedy completion afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

REQUESTS = 10_000


def test_ten_thousand_generated_requests_never_hurt_the_server(serve_bundle: Path) -> None:
    fuzz = [sys.executable, "tools/fuzz_server.py", str(serve_bundle), "--requests", str(REQUESTS)]
    done = subprocess.run(
        [*fuzz, "--seed", "0"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    assert summary["requests"] == REQUESTS and summary["ok"], summary
    assert summary["server_errors"] == 0 and summary["dropped"] == 0, summary
