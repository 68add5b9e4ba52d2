"""MLA decode: the latent (absorbed) form against the expanded-KV form, side by side.

One random DeepSeek-V3 checkpoint, tiny in layers but bandwidth-bound per step (hidden 2048, 16
heads of 128 + 64, kv_lora_rank 512, 4 layers, a long context), built twice: `mla.decode:
absorbed` (the default: a step reads the latent cache, one row of kv_lora_rank +
qk_rope_head_dim values per token, and attends in the latent space) and `mla.decode: expanded`
(a step up-projects every context token's latent into per-head keys and values, HF's form).
Alternating runs, medians, at several context lengths. Writes bench/results/mla.json.

    .venv/bin/python bench/mla.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, median, parse_args, write_result  # noqa: E402

WORK = REPO / "bench" / "work" / "mla"
CONFIG = dict(
    vocab_size=1024,
    hidden_size=2048,
    intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=768,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    first_k_dense_replace=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    max_position_embeddings=4096,
)
CONTEXT = 2048
MANIFEST = """neffkit: 1
name: mla-{form}
model: {model}
dtype: float32
buckets: {{prefill: [256], decode: [1], context: [{context}]}}
mla: {{decode: {form}}}
"""


def checkpoint() -> Path:
    out = WORK / "deepseek"
    if not (out / "config.json").exists():
        import transformers

        torch.manual_seed(0)
        config = transformers.DeepseekV3Config(**CONFIG)
        transformers.DeepseekV3ForCausalLM(config).save_pretrained(out)
    return out


def bundle(form: str) -> Path:
    manifest = WORK / f"mla-{form}.yaml"
    manifest.write_text(MANIFEST.format(form=form, model=checkpoint(), context=CONTEXT))
    return ensure_bundle(manifest, WORK / f"bundle-{form}")


def step_ms(engine, prompt_len: int, steps: int) -> float:
    from neffkit.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    seq = engine.add_request([1 + i % 1000 for i in range(prompt_len)], params)
    while not seq.output_ids:
        engine.step()
    t = engine.runner.timings
    before_s, before_n = t.decode_s, t.decode_steps
    while engine.has_work():
        engine.step()
    return 1000 * (t.decode_s - before_s) / max(t.decode_steps - before_n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts", type=int, nargs="+", default=[256, 1024, 1920])
    args = parse_args(ap)
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load

    engines = {form: EngineCore(load(bundle(form)).runner) for form in ("absorbed", "expanded")}
    rows = []
    for prompt in args.prompts:
        times: dict[str, list[float]] = {form: [] for form in engines}
        for _ in range(args.rounds):  # alternate: the machine's noise hits both alike
            for form, engine in engines.items():
                times[form].append(step_ms(engine, prompt, args.steps))
        absorbed, expanded = median(times["absorbed"]), median(times["expanded"])
        rows.append(
            {
                "context_tokens": prompt,
                "absorbed_ms": round(absorbed, 3),
                "expanded_ms": round(expanded, 3),
                "expanded_over_absorbed": round(expanded / absorbed, 2),
            }
        )
    lay = json.loads((WORK / "bundle-absorbed" / "bundle.json").read_text())["layout"]
    result = {
        "model": {**CONFIG, "context_bucket": CONTEXT},
        "latent_bytes_per_token": lay["num_layers"] * lay["head_dim"] * 4,
        "per_head_kv_bytes_per_token": CONFIG["num_hidden_layers"] * 16 * (128 + 64 + 128) * 4,
        "rows": rows,
    }
    print(json.dumps(result["rows"], indent=2))
    write_result("mla", result)


if __name__ == "__main__":
    main()
