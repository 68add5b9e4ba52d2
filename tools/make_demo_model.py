"""Write the demo checkpoint: a byte-level BPE tokenizer trained on the Python standard
library's own source (shipped with every interpreter, PSF license) and a small random-weight
Llama in HF format.

Deterministic for a given seed and Python version. Usage: python tools/make_demo_model.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def stdlib_files(limit: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < 200_000)
    return [str(p) for p in files[:limit]]


def train_tokenizer(vocab_size: int, files: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(files, trainer)
    return tok


def demo_config(
    vocab_size: int, eos_id: int, hidden: int, layers: int, initializer_range: float
) -> transformers.LlamaConfig:
    """The demo architecture: GQA (4 query, 2 KV heads), tied embeddings, 3x MLP."""
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        bos_token_id=None,
        initializer_range=initializer_range,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(args.vocab, stdlib_files(120))
    tok.save(str(args.out / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS)
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "bos_token": None,
                "add_bos_token": False,
                "model_max_length": 2048,
            },
            indent=2,
        )
        + "\n"
    )

    torch.manual_seed(args.seed)
    config = demo_config(tok.get_vocab_size(), eos_id, args.hidden, args.layers, 0.1)
    transformers.LlamaForCausalLM(config).save_pretrained(args.out)
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()}, eos {eos_id})")


if __name__ == "__main__":
    main()
