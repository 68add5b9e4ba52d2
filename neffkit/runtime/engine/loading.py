"""A rank-0 engine's load: the worker's graphs, the speculative proposer that runs beside them,
and the structured-output grammars over the bundle's tokenizer.

The worker loads one rank's graphs and knows nothing of proposers or grammars; a draft model (or
an MTP layer) is a bundle inside the bundle, loaded here with the same checks and attached to
the runner, since it runs in the target's process only (followers never run it).
"""

from __future__ import annotations

from pathlib import Path

from neffkit.contract.bundle import verify_files
from neffkit.contract.records import SpeculationRecord
from neffkit.errors import BundleError
from neffkit.runtime.engine.structured import Grammars
from neffkit.runtime.spec_decode.draft import DraftModel
from neffkit.runtime.spec_decode.mtp import MtpProposer
from neffkit.runtime.worker import loader
from neffkit.runtime.worker.loader import LoadedBundle


def load(
    path: str | Path,
    rank: int = 0,
    world_size: int = 1,
    verify: bool = True,
    executor: str = "auto",
) -> LoadedBundle:
    """`worker.loader.load`, with the bundle's draft model (or MTP layer) attached."""
    loaded = loader.load(path, rank, world_size, verify=verify, executor=executor)
    return attach_proposer(loaded) if rank == 0 else loaded


def attach_proposer(loaded: LoadedBundle) -> LoadedBundle:
    """Load the draft bundle inside `loaded` (speculation.method draft or mtp) onto its runner."""
    spec = loaded.runner.config.speculation
    if spec is None or not spec.draft or loaded.runner.draft is not None:
        return loaded
    if loaded.verify:  # its bundle.json names its files' hashes; this one names its bundle.json's
        verify_files(loaded.bundle, [f"{spec.draft}/bundle.json"])
    loaded.runner.draft = _load_draft(loaded, spec)
    return loaded


def _load_draft(loaded: LoadedBundle, spec: SpeculationRecord) -> DraftModel | MtpProposer:
    """The draft model's (or MTP layer's) bundle inside this one; one block table must address
    both caches."""
    bundle = loaded.bundle
    draft = loader.load(bundle.path(spec.draft), verify=loaded.verify, executor=loaded.executor)
    mine, its = bundle.record.layout, draft.bundle.record.layout
    if (its.block_size, its.num_blocks) != (mine.block_size, mine.num_blocks):
        raise BundleError(
            f"{bundle.root}: the draft model's KV cache ({its.num_blocks} blocks of "
            f"{its.block_size}) differs from the target's ({mine.num_blocks} of {mine.block_size})",
            hint="rebuild the bundle: neffkit build derives the draft's cache from the target's",
        )
    if spec.method == "mtp":
        return MtpProposer(draft.runner, spec)
    return DraftModel(draft.runner, spec)


def grammars_of(loaded: LoadedBundle) -> Grammars | None:
    """Structured-output grammars over the bundle's tokenizer (None: it has none)."""
    config = loaded.runner.config
    return Grammars.of(loaded.tokenizer, config.vocab_size, config.eos_token_ids)
