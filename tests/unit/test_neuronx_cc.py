"""How a failed neuronx-cc run is explained: a real process that dies of each signal or exits
non-zero (a shell script in neuronx-cc's place), the error naming the graph, what happened, the
likely cause and the log's last lines. The CLI path of one such failure (exit status 2, nothing
half-written) is tests/e2e/test_neuron.py's."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from neffkit.compile.backends.neuron.neuronx_cc import run_neuronx_cc
from neffkit.errors import BuildError


@pytest.mark.parametrize(
    ("ending", "expected", "hint"),
    [
        (f"kill -{int(signal.SIGKILL)} $$", "out-of-memory", "-j 1"),
        (f"kill -{int(signal.SIGABRT)} $$", "aborted (SIGABRT)", "compiler.per_graph"),
        (f"kill -{int(signal.SIGSEGV)} $$", "crashed (SIGSEGV)", "-O1"),
        (f"kill -{int(signal.SIGTERM)} $$", "died of signal 15", "see the log"),
        ("exit 70", "failed with exit status 70", "first error"),
    ],
)
def test_a_failed_compile_says_what_happened(tmp_path: Path, ending, expected, hint) -> None:
    binary = tmp_path / "neuronx-cc"
    binary.write_text(f"#!/bin/sh\necho 'pass 7: tensorizer error'\n{ending}\n")
    binary.chmod(0o755)
    log = tmp_path / "log" / "neuronx-cc.log"
    argv = ["neuronx-cc", "compile", "in.hlo.pb", "--output", "out.neff"]
    with pytest.raises(BuildError) as err:
        run_neuronx_cc(str(binary), argv, tmp_path, log, "decode_b1_c64")
    message = str(err.value)
    assert message.startswith("decode_b1_c64: neuronx-cc ") and expected in message, message
    assert f"log: {log}" in message and "| pass 7: tensorizer error" in message
    assert hint in err.value.hint


def test_a_compile_that_writes_no_neff_is_an_error(tmp_path: Path) -> None:
    binary = tmp_path / "neuronx-cc"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    argv = ["neuronx-cc", "compile", "in.hlo.pb", "--output", "out.neff"]
    with pytest.raises(BuildError, match="exited 0 but wrote no valid NEFF"):
        run_neuronx_cc(str(binary), argv, tmp_path, tmp_path / "cc.log", "prefill_t16_c64")
