"""A stand-in for nkipy's `spike` (the Neuron runtime's Python bindings), for tests only.

It reproduces the signatures and checks of aws-neuron/nkipy `spike/src/spike/spike_model.py` and
`spike_tensor.py` (read for this stand-in): `SpikeTensor.from_numpy(array, name, core_id)`,
`.numpy()`, `.write_from_numpy(array)` (in place, same size); `SpikeModel.load_from_neff(path,
name, core_id, cc_enabled, rank_id, world_size)`, its `input_tensors_info` /
`output_tensors_info` (name → shape, dtype, size), and `model(inputs={name: SpikeTensor},
outputs={name: SpikeTensor})`, which rejects unknown names and wrong shapes or dtypes, writes
into the given output tensors and returns None (a dict of new tensors only when `outputs` is
None). Names follow the NEFF's tensor naming as neffkit assumes it: input{i} is HLO parameter i,
output{j} result element j.

Execution is not a NeuronCore's: the stand-in neuronx-cc packs the HLO module into its NEFF, and
this runs that HLO on XLA:CPU (one rank; collectives are not executed). Every call is counted in
`CALLS` (and appended to $SPIKE_STAND_IN_LOG as JSON lines) so tests can see uploads, reads and
load arguments.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

CALLS: list[dict] = []
HLO_DTYPES = {
    "s64": "int64",
    "s32": "int32",
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "pred": "bool",
    "u8": "uint8",
    "s8": "int8",
    "f8e4m3fn": "int8",
}  # fp8: the NEFF records int8 (spike_model.py's FIXME)


def _log(kind: str, **data) -> None:
    entry = {"call": kind, **data}
    CALLS.append(entry)
    if os.environ.get("SPIKE_STAND_IN_LOG"):
        with open(os.environ["SPIKE_STAND_IN_LOG"], "a") as f:
            f.write(json.dumps(entry) + "\n")


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class SpikeTensor:
    """A tensor 'on device': a private copy of the bytes it was given."""

    def __init__(self, data: np.ndarray, name: str | None, core_id: int) -> None:
        self._data = data
        self.shape, self.dtype, self.name = data.shape, data.dtype, name
        self.tensor_ref = SimpleNamespace(core_id=core_id)

    @classmethod
    def from_numpy(cls, array: np.ndarray, name: str | None = None, core_id: int = 0):
        _log("from_numpy", name=name, nbytes=int(np.asarray(array).nbytes))
        return cls(np.array(array, copy=True, order="C"), name, core_id)

    def numpy(self) -> np.ndarray:
        _log("numpy", name=self.name, nbytes=int(self._data.nbytes))
        return self._data.copy()

    def write_from_numpy(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes != self._data.nbytes:
            raise ValueError(
                f"Size mismatch: source {array.nbytes} bytes, target {self._data.nbytes} bytes"
            )
        _log("write_from_numpy", name=self.name, nbytes=int(array.nbytes))
        self._data[...] = array.view(self._data.dtype).reshape(self._data.shape)


def _signature(proto: bytes) -> tuple[list[tuple[str, tuple]], list[tuple[str, tuple]]]:
    """(parameters, results) of the module's entry, in order: (HLO dtype, shape) each."""
    from jaxlib._hlo import HloModule

    text = HloModule.from_serialized_hlo_module_proto(proto).to_string()

    def types(part: str) -> list[tuple[str, tuple]]:
        return [
            (t, tuple(int(d) for d in s.split(",") if d))
            for t, s in re.findall(r"(\w+)\[([\d,]*)\]", part)
        ]

    entry = next(line for line in text.splitlines() if line.startswith("ENTRY"))
    params = types(entry[entry.index("(") : entry.index(") ->")])
    results = types(entry[entry.index(") ->") :])
    return params, results


class SpikeModel:
    def __init__(self, neff_path: Path, name: str, core_id: int) -> None:
        with tarfile.open(fileobj=io.BytesIO(neff_path.read_bytes()[1024:])) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(".hlo.pb"))
            self._proto = tar.extractfile(member).read()
        self.name, self.neff_path = name, neff_path
        self.model_ref = SimpleNamespace(core_id=core_id)
        params, results = _signature(self._proto)

        def info(dtype: str, shape: tuple) -> SimpleNamespace:
            np_dtype = HLO_DTYPES[dtype]
            return SimpleNamespace(
                shape=list(shape),
                dtype=np_dtype,
                size=int(np.prod(shape)) * _np_dtype(np_dtype).itemsize,
            )

        self.input_tensors_info = {f"input{i}": info(*p) for i, p in enumerate(params)}
        self.output_tensors_info = {f"output{j}": info(*r) for j, r in enumerate(results)}
        self._executable = None

    @classmethod
    def load_from_neff(
        cls, neff_path, name=None, core_id=0, cc_enabled=False, rank_id=0, world_size=1
    ):
        neff_path = Path(neff_path)
        _log(
            "load_from_neff",
            path=str(neff_path),
            name=name,
            core_id=core_id,
            cc_enabled=cc_enabled,
            rank_id=rank_id,
            world_size=world_size,
        )
        return cls(neff_path, name or neff_path.stem, core_id)

    def _validate(self, tensors: dict, infos: dict, kind: str) -> None:
        unknown = set(tensors) - set(infos)
        if unknown:
            raise ValueError(
                f"Unknown {kind}(s) {unknown} for model '{self.name}'. "
                f"Expected {kind}s: {list(infos)}"
            )
        for k, v in tensors.items():
            assert v.tensor_ref.core_id == self.model_ref.core_id, k
            assert v.shape == tuple(infos[k].shape), (k, v.shape, infos[k].shape)
            want = infos[k].dtype
            if want == "int8" and v.dtype.itemsize == 1:
                continue  # fp8 travels as int8
            assert v.dtype == _np_dtype(want), (k, v.dtype, want)

    def __call__(self, inputs, outputs=None, save_trace=False, ntff_name=None):
        auto = outputs is None
        if auto:
            outputs = {
                k: SpikeTensor(np.zeros(i.shape, _np_dtype(i.dtype)), k, self.model_ref.core_id)
                for k, i in self.output_tensors_info.items()
            }
        self._validate(inputs, self.input_tensors_info, "input")
        self._validate(outputs, self.output_tensors_info, "output")
        missing = set(self.input_tensors_info) - set(inputs)
        if missing:
            raise ValueError(f"missing input(s) {sorted(missing)} for model '{self.name}'")
        from neffkit.platform.xla_cpu import XlaCpu

        xla = XlaCpu()
        if self._executable is None:
            self._executable = xla.compile(self._proto)
        args = [xla.put(inputs[f"input{i}"]._data) for i in range(len(inputs))]
        results = xla.run(self._executable, args)
        _log("execute", name=self.name)
        for j, value in enumerate(results):
            key = f"output{j}"
            if key in outputs:
                target = outputs[key]
                target._data[...] = np.asarray(value).view(target._data.dtype)
        return outputs if auto else None
