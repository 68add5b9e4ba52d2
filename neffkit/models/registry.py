"""The registry of model families: architecture name → the family that reads and builds it.

The single list of what neffkit can build (the manifest's errors, the docs' table and the tests'
matrix come from it). Each family is a package `neffkit.models.<family>` with a torch-free
`config.py` (its ModelConfig subclass, read from config.json) and a `model.py` (its graph module
and its sharding rules, both over the shared decoder in models/decoder.py and models/shards.py).
The build (compile/) reaches models only through this module; family modules are imported
lazily, so reading a config imports no torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffkit.errors import ModelError
from neffkit.models.config import ModelConfig, read_config_json

if TYPE_CHECKING:
    from neffkit.contract.abi import GraphShape
    from neffkit.models.decoder import DecoderGraph
    from neffkit.models.forms import ProjectionPolicy
    from neffkit.models.parallel import Parallelism
    from neffkit.models.shards import Shards

__all__ = [
    "ARCHITECTURES",
    "Family",
    "ModelConfig",
    "DERIVED",
    "build_graph",
    "family_of",
    "mtp_model_config",
    "takes_hidden",
    "graph_class",
    "read_model_config",
    "shards_class",
]

ADDING_A_MODEL = "docs/adding-a-model.md"


@dataclass(frozen=True)
class Family:
    """Where one architecture's parts live: `neffkit.models.<package>.config.<config>` and
    `neffkit.models.<package>.model.<graph>` / `.<shards>`."""

    package: str
    config: str
    graph: str
    shards: str


_LLAMA = Family("llama", "LlamaConfig", "LlamaGraph", "LlamaShards")
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "MixtralForCausalLM": Family("moe", "MoeConfig", "MoeGraph", "MixtralShards"),
    "Qwen3MoeForCausalLM": Family("moe", "MoeConfig", "MoeGraph", "MoeShards"),
    "Llama4ForCausalLM": Family("llama4", "Llama4Config", "Llama4Graph", "Llama4Shards"),
    "GptOssForCausalLM": Family("gpt_oss", "GptOssConfig", "GptOssGraph", "GptOssShards"),
    "Phi3ForCausalLM": Family("phi3", "Phi3Config", "Phi3Graph", "Phi3Shards"),
    "CohereForCausalLM": Family("cohere", "CohereConfig", "CohereGraph", "CohereShards"),
    "GraniteForCausalLM": Family("granite", "GraniteConfig", "GraniteGraph", "GraniteShards"),
    "OlmoForCausalLM": Family("olmo", "OlmoConfig", "OlmoGraph", "OlmoShards"),
    "Olmo2ForCausalLM": Family("olmo", "OlmoConfig", "OlmoGraph", "OlmoShards"),
    "Gemma2ForCausalLM": Family("gemma", "GemmaConfig", "GemmaGraph", "GemmaShards"),
    "Gemma3ForCausalLM": Family("gemma", "GemmaConfig", "GemmaGraph", "GemmaShards"),
    "DeepseekV3ForCausalLM": Family(
        "deepseek_v3", "DeepseekV3Config", "DeepseekV3Graph", "DeepseekV3Shards"
    ),
}
# models neffkit derives from a checkpoint rather than reads from a config.json: DeepSeek-V3's
# multi-token prediction layer (speculation.method: mtp)
DERIVED: dict[str, Family] = {
    "DeepseekV3MTP": Family(
        "deepseek_v3", "DeepseekV3MtpConfig", "DeepseekV3MtpGraph", "DeepseekV3MtpShards"
    ),
}


def family_of(architecture: str | None, where: str = "config.json") -> Family:
    """The family of an architecture; an unknown one is refused with the supported list."""
    if architecture not in ARCHITECTURES:
        raise ModelError(
            f"{where}: architecture {architecture!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)}",
            hint=f"a new architecture is a family module behind the registry: see {ADDING_A_MODEL}",
        )
    return ARCHITECTURES[architecture]


def _part(family: Family, module: str, name: str) -> Any:
    return getattr(importlib.import_module(f"neffkit.models.{family.package}.{module}"), name)


def read_model_config(model_dir: Path) -> ModelConfig:
    """Parse `model_dir/config.json` (+ generation_config.json for EOS ids) by its family."""
    path = model_dir / "config.json"
    raw = read_config_json(model_dir)
    archs = raw.get("architectures") or []
    family = family_of(archs[0] if archs else None, str(path))
    try:
        return _part(family, "config", family.config).read(raw, path)
    except KeyError as exc:
        raise ModelError(f"{path}: missing required key {exc.args[0]!r}") from exc


def mtp_model_config(target: ModelConfig) -> ModelConfig:
    """The target checkpoint's first multi-token prediction layer as a model of its own
    (speculation.method: mtp); a ModelError where the family has none."""
    if target.architecture != "DeepseekV3ForCausalLM":
        raise ModelError(
            field="speculation.method",
            message=f"mtp needs a DeepSeek-V3 checkpoint with multi-token prediction layers; "
            f"this one is {target.architecture}",
            hint="use method ngram or draft",
        )
    family = ARCHITECTURES[target.architecture]
    return _part(family, "config", "mtp_config")(target)


def takes_hidden(cfg: ModelConfig) -> bool:
    """Does this model predict from a hidden state given as input (an MTP layer)?"""
    return cfg.architecture in DERIVED


def _family_of_config(cfg: ModelConfig) -> Family:
    return DERIVED.get(cfg.architecture) or family_of(cfg.architecture)


def graph_class(cfg: ModelConfig) -> type[DecoderGraph]:
    """The graph module class that builds this config's graphs (imports torch)."""
    family = _family_of_config(cfg)
    return _part(family, "model", family.graph)


def shards_class(cfg: ModelConfig) -> type[Shards]:
    """The sharding rules that cut this config's checkpoint into rank shards (imports torch)."""
    family = _family_of_config(cfg)
    return _part(family, "model", family.shards)


def build_graph(
    cfg: ModelConfig,
    shape: GraphShape,
    weight_names: list[str],
    max_top_k: int,
    par: Parallelism,
    projection: ProjectionPolicy,
    fp8_max: float,
    options: dict[str, str] | None = None,
) -> DecoderGraph:
    """The eager module of one graph: what is traced, and the oracle `build --verify` compares
    artifacts against. `options` are the family's own (DeepSeek: mla_decode)."""
    return graph_class(cfg)(
        cfg, shape, weight_names, max_top_k, par, projection, fp8_max, **(options or {})
    )
