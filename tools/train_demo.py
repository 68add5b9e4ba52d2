"""Train the demo model: a small Llama on the Python standard library's own source, on the CPU.

The text ships with every interpreter (PSF license), so the model is reproducible offline. The
tokenizer is the demo's byte-level BPE (`tools/make_demo_model.py`, trained with `tokenizers` on
the same source); this script keeps it, so the test suite's checkpoints share its vocabulary.
Deterministic for a seed, Python version and torch version (fixed step count, seeded sampling).
Writes HF format (bfloat16 safetensors, a few MB), ready for `neffkit build`.

    python tools/train_demo.py models/demo-llama            # ~15 min on 2 cores
    python tools/train_demo.py /tmp/x --steps 20            # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from make_demo_model import EOS, demo_config  # tools/ is this script's directory
from tokenizers import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def corpus_files(max_bytes: int) -> list[Path]:
    """Standard-library sources in a fixed order, tests left out, up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("test", "tests", "site-packages", "idle_test") for p in rel):
            continue
        size = path.stat().st_size
        if size > 300_000:
            continue
        files.append(path)
        total += size
        if total >= max_bytes:
            break
    return files


def encode_corpus(tok: Tokenizer, files: list[Path]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, default=Path("models/demo-llama"))
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--corpus-mb", type=float, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(str(args.tokenizer_from / "tokenizer.json"))
    t0 = time.perf_counter()
    data = encode_corpus(tok, corpus_files(int(args.corpus_mb * 1e6)))
    split = int(len(data) * 0.99)
    train, held_out = data[:split], data[split:]
    print(f"corpus: {len(data) / 1e6:.1f}M tokens ({time.perf_counter() - t0:.1f}s to encode)")

    config = demo_config(tok.get_vocab_size(), tok.token_to_id(EOS), args.hidden, args.layers, 0.02)
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters, {args.steps} steps of {args.batch}x{args.seq}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)

    def batch(source: np.ndarray) -> torch.Tensor:
        starts = rng.integers(0, len(source) - args.seq - 1, args.batch)
        return torch.from_numpy(np.stack([source[s : s + args.seq] for s in starts]))

    model.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=30)
        ids = batch(train)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - t0
            print(
                f"step {step:>4}/{args.steps}  loss {loss.item():.3f}  {elapsed:5.0f}s", flush=True
            )

    model.eval()
    losses = []
    with torch.no_grad():
        for _ in range(8):
            ids = batch(held_out)
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    held = float(np.mean(losses))
    print(f"held-out loss {held:.3f} (perplexity {math.exp(held):.1f})")

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.tokenizer_from / name).resolve() != (args.out / name).resolve():
            shutil.copyfile(args.tokenizer_from / name, args.out / name)
    (args.out / "training.json").write_text(
        json.dumps(
            {
                "corpus": "CPython standard library sources (tests excluded), PSF license",
                "tokens": int(len(data)),
                "parameters": params,
                "steps": args.steps,
                "batch": args.batch,
                "seq": args.seq,
                "lr": args.lr,
                "seed": args.seed,
                "held_out_loss": round(held, 4),
                "seconds": round(time.perf_counter() - t0, 1),
                "torch": torch.__version__,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
