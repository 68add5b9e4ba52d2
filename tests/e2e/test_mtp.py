"""DeepSeek-V3's multi-token prediction layer as the proposer (speculation.method: mtp) on a
tiny DeepSeek-V3 whose checkpoint carries one MTP layer (random weights, as the release stores
them: `model.layers.{num_hidden_layers}.*`). The proposals equal an eager reference (HF's
DeepseekV3DecoderLayer for the block, vLLM's deepseek_mtp.py for the glue), the outputs equal
the same bundle decoding plainly over 200 requests at batch 1 and 4, and the MTP layer's graphs
lower for neuron and run on XLA:CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.e2e.test_speculation import _assert_equal_outputs, _generate, _random_workload
from tests.support.bundles import build_session_bundle, lowered_build, prebuild
from tests.support.cache import cached_dir
from tests.support.cli import run_cli
from tests.support.models import LEAN_SAMPLING, model_digest

# max_batch 1: batches of 4 decode plainly while the MTP layer sits out, so single rows then
# catch up on many positions (several 1 + K chunks)
SPEC = {"method": "mtp", "num_tokens": 3, "max_batch": 1}
BUCKETS = {"prefill": [16], "decode": [1, 4], "context": [64]}
MTP_SOURCES = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens")


def _add_mtp_layer(source: Path, out: Path) -> None:
    """The test deepseek checkpoint plus a random MTP layer at index num_hidden_layers: a
    decoder block shaped like the last one, enorm, hnorm, eh_proj, shared_head and (as the
    release does) its own copy of the embeddings."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out, dirs_exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    n = config["num_hidden_layers"]
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(source / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    last = f"model.layers.{n - 1}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            fresh = torch.randn(t.shape, generator=gen) * 0.2
            if name.endswith(("norm.weight", "layernorm.weight")):
                fresh = 1.0 + fresh
            tensors[f"model.layers.{n}." + name.removeprefix(last)] = fresh.to(t.dtype)
    p = f"model.layers.{n}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{p}{norm}.weight"] = 1.0 + torch.randn(hidden, generator=gen) * 0.2
    tensors[f"{p}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    tensors[f"{p}shared_head.head.weight"] = torch.randn(vocab, hidden, generator=gen) * 0.2
    tensors[f"{p}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )


def mtp_model_dir(hf_model_dir) -> Path:
    import hashlib
    import inspect

    recipe = model_digest("deepseek") + inspect.getsource(_add_mtp_layer)
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    source = hf_model_dir("deepseek")
    return cached_dir(f"models/deepseek-mtp-{digest}", lambda out: _add_mtp_layer(source, out))


@prebuild("deepseek_mtp")
def build_mtp_bundle(session_dir: Path, hf_model_dir) -> Path:
    return build_session_bundle(
        session_dir,
        mtp_model_dir(hf_model_dir),
        "deepseek_mtp",
        buckets=BUCKETS,
        speculation=SPEC,
        sampling={**LEAN_SAMPLING, "max_logprobs": 2},
    ).bundle


@pytest.fixture(scope="module")
def mtp_model(hf_model_dir) -> Path:
    return mtp_model_dir(hf_model_dir)


@pytest.fixture(scope="module")
def mtp_bundle(session_dir: Path, hf_model_dir) -> Path:
    return build_mtp_bundle(session_dir, hf_model_dir)


class EagerMtp:
    """The reference: the target's hidden states from HF's model (the final norm's input), and
    the MTP layer eagerly: HF's DeepseekV3DecoderLayer for its block, vLLM's glue around it."""

    def __init__(self, model_dir: Path) -> None:
        import transformers
        from safetensors.torch import load_file
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        config = transformers.AutoConfig.from_pretrained(model_dir)
        config._attn_implementation = "eager"
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, config=config)
        self.model.eval()
        n = config.num_hidden_layers
        weights = load_file(model_dir / "model.safetensors")
        p = f"model.layers.{n}."
        mine = {k.removeprefix(p): v for k, v in weights.items() if k.startswith(p)}
        self.block = hf.DeepseekV3DecoderLayer(config, layer_idx=n).eval()
        block = {k: v for k, v in mine.items() if not k.startswith(MTP_SOURCES)}
        experts = sorted({int(k.split(".")[2]) for k in block if k.startswith("mlp.experts.")})
        if experts:  # the checkpoint's per-expert tensors, fused as HF's module holds them
            one = [f"mlp.experts.{e}." for e in experts]
            block["mlp.experts.gate_up_proj"] = torch.stack(
                [
                    torch.cat((block[f"{e}gate_proj.weight"], block[f"{e}up_proj.weight"]))
                    for e in one
                ]
            )
            block["mlp.experts.down_proj"] = torch.stack(
                [block[f"{e}down_proj.weight"] for e in one]
            )
            block = {k: v for k, v in block.items() if not k.startswith(tuple(one))}
        self.block.load_state_dict(block, strict=False)  # HF's rotary buffers are its own
        assert not (set(self.block.state_dict()) - set(block) - {"self_attn.rotary_emb.inv_freq"})

        def norm(name: str):
            module = hf.DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
            module.weight.data = mine[f"{name}.weight"]
            return module

        self.enorm, self.hnorm, self.head_norm = (
            norm("enorm"),
            norm("hnorm"),
            norm("shared_head.norm"),
        )
        self.eh_proj, self.head = mine["eh_proj.weight"], mine["shared_head.head.weight"]
        self.embed = mine["embed_tokens.weight"]
        self._captured: list[torch.Tensor] = []
        self.model.model.norm.register_forward_hook(lambda m, i, o: self._captured.append(i[0]))

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        self._captured.clear()
        self.model(torch.tensor([tokens]))
        return self._captured[0][0]  # [T, H], before the final norm

    @torch.no_grad()
    def layer(self, following: list[int], previous: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Positions 0.. with token p + 1 and hidden state `previous[p]`: outputs and argmaxes."""
        t = len(following)
        positions = torch.arange(t)
        e = self.embed[torch.tensor(following)]
        e[positions == 0] = 0
        x = torch.cat((self.enorm(e), self.hnorm(previous)), dim=-1) @ self.eh_proj.t()
        cos_sin = self.model.model.rotary_emb(x[None], positions[None])
        mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)[None, None]
        g = self.block(
            x[None], attention_mask=mask, position_ids=positions[None], position_embeddings=cos_sin
        )[0]
        return g, (self.head_norm(g) @ self.head.t()).argmax(-1).tolist()

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """What the MTP recurrence proposes after `tokens`: the layer over the target's hidden
        states up to the second-to-last token, then on its own output hidden state."""
        h = self.target_hidden(tokens[:-1])  # h_0 .. h_{L-2}
        following, previous, out = list(tokens[1:]), h, []
        for _ in range(k):
            g, argmax = self.layer(following, previous)
            out.append(argmax[-1])
            following.append(argmax[-1])
            previous = torch.cat((previous, g[-1:]))
        return out


def test_mtp_drafts_equal_an_eager_reference(mtp_bundle, mtp_model, monkeypatch):
    """Every proposal of a batch-1 and a batch-4 run (after prefills, verify steps and plain
    batch-4 steps the layer sat out) equals the eager recurrence on the same tokens. Random MTP
    weights are rejected every step, so the back-off is turned off: every step proposes."""
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams
    from neffkit.runtime.spec_decode import proposer as speculation

    loaded = load(mtp_bundle)
    proposer = loaded.runner.draft
    record = json.loads((mtp_bundle / "draft" / "bundle.json").read_text())
    assert record["model"]["architecture"] == "DeepseekV3MTP"
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = proposer.propose

    def recording(rows, ks):
        drafts = propose(rows, ks)
        for seq, k, d in zip(rows, ks, drafts, strict=True):
            if k:
                seen.append((seq.prompt_ids + seq.output_ids, k, d))
        return drafts

    proposer.propose = recording
    monkeypatch.setattr(speculation, "MISSES_BEFORE_BACKOFF", 10**6)
    prompts = [[5, 6, 7, 8, 9], list(range(100, 123)), [7, 300, 9, 1000, 2], [11, 12, 13]]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 4
    _generate(EngineCore(loaded.runner), prompts, params, True)  # 4 at once, then fewer
    _generate(EngineCore(loaded.runner), prompts[:1], params[:1], False)
    assert len(seen) > 10 and max(len(t) for t, _, _ in seen) > 20
    eager = EagerMtp(mtp_model)
    for tokens, k, drafts in seen:
        assert drafts == eager.drafts(tokens, k), tokens


@pytest.mark.parametrize("together", [False, True], ids=["batch1", "batch4"])
def test_mtp_outputs_equal_plain_decoding(mtp_bundle, together, monkeypatch):
    """200 requests, stops and max_tokens inside what plain decoding generates: outputs equal
    the same bundle decoding plainly (batch 4 speculates once rows thin out to max_batch 1;
    the back-off is off so that every step proposes)."""
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.spec_decode import proposer as speculation

    monkeypatch.setattr(speculation, "MISSES_BEFORE_BACKOFF", 10**6)
    loaded = load(mtp_bundle)
    prompts, _, params = _random_workload(loaded, together)
    spec_core = EngineCore(loaded.runner)
    with_spec = _generate(spec_core, prompts, params, together)
    plain = _generate(EngineCore(loaded.runner, speculation=False), prompts, params, together)
    _assert_equal_outputs(params, with_spec, plain)
    assert spec_core.scheduler.spec.draft_tokens > (0 if together else 300)


@pytest.mark.full  # MTP on cpu and the verify graphs on XLA:CPU stay in `make test`
def test_mtp_graphs_lower_for_neuron_and_run_on_xla_cpu(session_dir, mtp_model, hf_greedy):
    bundle = lowered_build(
        session_dir,
        mtp_model,
        "deepseek_mtp_neuron",
        "--lower-only",
        buckets={"prefill": [16], "decode": [1], "context": [64]},
        speculation=SPEC,
    )
    for root in (bundle, bundle / "draft"):
        findings = json.loads(run_cli("inspect", str(root), "--json").stdout)["findings"]
        assert [f for f in findings if f["severity"] == "error"] == []
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    prompts = [[9, 8, 7, 9, 8, 7, 9, 8], [100, 200, 300]]
    loaded = load(bundle, executor="xla-cpu")
    core = EngineCore(loaded.runner)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 2
    seqs = _generate(core, prompts, params, False)
    assert [s.output_ids for s in seqs] == [hf_greedy(mtp_model, p, 12) for p in prompts]
    assert core.scheduler.spec.draft_tokens > 0


def test_a_row_too_far_behind_stops_drafting_and_keeps_no_hidden_states(mtp_bundle, monkeypatch):
    """Four rows decode plainly (max_batch 1) and keep their target hidden states for the MTP
    layer to catch up on; past PENDING_STEPS calls' worth (1 here: 4 states) a row stops
    drafting and keeps none. Outputs still equal plain decoding."""
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams
    from neffkit.runtime.spec_decode import mtp

    monkeypatch.setattr(mtp, "PENDING_STEPS", 1)
    loaded = load(mtp_bundle)
    proposer, most = loaded.runner.draft, [0]
    observe = proposer.observe

    def watching(batch, out):
        observe(batch, out)
        most[0] = max(most[0], *(len(s.drafting.hidden) for s in batch.rows))

    proposer.observe = watching
    prompts = [[5, 6, 7, 8, 9], list(range(100, 123)), [7, 300, 9, 1000, 2], [11, 12, 13]]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 4
    seqs = _generate(EngineCore(loaded.runner), prompts, params, True)
    plain = _generate(EngineCore(loaded.runner, speculation=False), prompts, params, True)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    assert most[0] <= 4 and any(s.drafting.stopped for s in seqs)
