"""Make a draft model from a checkpoint's first layers: its embeddings, first N decoder layers,
final norm and LM head, unchanged (a "layer-skip" draft, as self-speculative decoding uses).

    python tools/draft_from_layers.py models/smollm2-135m-instruct --layers 6 \
        -o models/smollm2-draft6

The draft shares the target's tokenizer by construction (the tokenizer files are copied), so
`speculation: {method: draft, model: ...}` accepts it. No training: its drafts agree with the
target where the first layers already decide the next token. Reads and writes safetensors and
config.json only (no transformers).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# per-layer lists in a config: cut to the kept layers
PER_LAYER_LISTS = ("layer_types", "no_rope_layers", "sliding_window_pattern")


def draft_from_layers(model: Path, layers: int, out: Path) -> Path:
    config = json.loads((model / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 0 < layers < total:
        raise SystemExit(
            f"--layers: expected 1 to {total - 1} (the model has {total}), got {layers}"
        )
    config["num_hidden_layers"] = layers
    for key in PER_LAYER_LISTS:
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                match = LAYER.match(name)
                if match is None or int(match.group(1)) < layers:
                    tensors[name] = f.get_tensor(name).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in model.iterdir():  # tokenizer, chat template, generation config
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            if not path.name.startswith(("model.safetensors.index", ".")):
                shutil.copyfile(path, out / path.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="the target's HF checkpoint directory")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    print(draft_from_layers(args.model, args.layers, args.output))


if __name__ == "__main__":
    main()
