"""The end of a graph's forward: the final norm and LM head where sampling needs them, then
on-device sampling (kernels/sampling.py) after the logit inputs (kernels/logits.py), prompt
logprobs on prefill, and speculative decoding's verify step, which samples every position and
accepts each row's drafts in the graph. Its own module because it is the same for every family:
they change what it calls (`norm`, `logits`), never how a token is chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from neffkit.contract import abi
from neffkit.kernels.logits import LogitInputs, process
from neffkit.kernels.sampling import sample, target_logprobs

if TYPE_CHECKING:
    from neffkit.contract.abi import GraphShape
    from neffkit.models.config import ModelConfig
    from neffkit.models.forms import ProjectionPolicy


class SamplingHead:
    """Mixed into DecoderGraph: it supplies `cfg`, `shape`, `projection`, `max_top_k`,
    `final_norm` and `logits`."""

    if TYPE_CHECKING:  # DecoderGraph's
        cfg: ModelConfig
        shape: GraphShape
        projection: ProjectionPolicy
        max_top_k: int

        def final_norm(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor: ...
        def logits(
            self, x: torch.Tensor, head: torch.Tensor, rank: torch.Tensor | None
        ) -> torch.Tensor: ...

    def _sample(
        self,
        h: torch.Tensor,
        m: dict[str, torch.Tensor],
        w: dict[str, torch.Tensor],
        rank: torch.Tensor | None,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The final norm and LM head where sampling needs them, then on-device sampling; prefill
        with prompt logprobs runs the head on every position (TRT-LLM's context logits)."""
        cfg, shape = self.cfg, self.shape
        positions = m[abi.POSITIONS]
        temperature, top_k, top_p, seed = (m[name] for name in abi.SAMPLING_NAMES)
        head = w["lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"]
        prompt: tuple[torch.Tensor, ...] = ()
        if shape.rule.samples_every_position:
            return self._verify(h, m, w, rank, head), prompt
        if shape.rule.packed:
            tokens = positions.shape[1]
            # [S]: each sequence's last token in the row; clamped like every index from the
            # host (audit NK303: a gather past the chunk would be an out-of-bounds DMA on Neuron)
            last = m[abi.LAST_TOKEN_INDEX].clamp(0, tokens - 1)
            last_pos = positions[0].index_select(0, last)  # [S]
            if shape.prompt_logprobs:
                h_all = self.final_norm(h[0], w)
                all_logits = self.logits(h_all, head, rank)  # [T, vocab]
                targets = m[abi.TARGET_IDS][0].clamp(0, cfg.vocab_size - 1)  # [T]
                prompt = target_logprobs(all_logits, targets, shape.logprobs)
                logits = all_logits.index_select(0, last)  # [1, vocab]
            else:
                h_last = self.final_norm(h[0].index_select(0, last), w)
                logits = self.logits(h_last, head, rank)  # [1, vocab]
        else:
            last_pos = positions[:, -1]  # [B]
            h_last = self.final_norm(h[:, -1], w)
            logits = self.logits(h_last, head, rank)  # [B, vocab]
        branches = self.projection.sampler_branches
        masked, processed = process(logits, LogitInputs.of(m, abi.LOGIT_INPUTS), branches)
        sampled = sample(
            masked,
            temperature,
            top_k,
            top_p,
            seed,
            last_pos,
            self.max_top_k,
            shape.logprobs,
            processed,
            branches,
        )
        return sampled, prompt

    def _verify(
        self,
        h: torch.Tensor,
        m: dict[str, torch.Tensor],
        w: dict[str, torch.Tensor],
        rank: torch.Tensor | None,
        head: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Speculative decoding's verify step: every position sampled as a decode step at that
        position samples (the same seed and position, so the same token), and each row's drafts
        (its input tokens after the first) accepted while they equal what was sampled before
        them. A draft is a point mass, so this is rejection sampling exactly: a draft is kept
        with the probability the target gives it, and a rejected one is replaced by a sample of
        the target's distribution without it. Returns the sampled tokens [B, T], each row's
        emitted count (accepted + 1) and the logprobs per position."""
        rows, tokens, _ = h.shape
        x = self.final_norm(h.reshape(rows * tokens, -1), w)
        logits = self.logits(x, head, rank)  # [B*T, vocab]
        temperature, top_k, top_p, seed = (
            m[name].repeat_interleave(tokens) for name in abi.SAMPLING_NAMES
        )
        positions = m[abi.POSITIONS].reshape(-1)
        inputs = LogitInputs.of(m, abi.LOGIT_INPUTS).per_position(tokens)
        branches = self.projection.sampler_branches
        masked, processed = process(logits, inputs, branches)
        s = sample(
            masked,
            temperature,
            top_k,
            top_p,
            seed,
            positions,
            self.max_top_k,
            self.shape.logprobs,
            processed,
            branches,
        )
        sampled = s.next_tokens.view(rows, tokens)
        drafts = m[abi.INPUT_IDS][:, 1:]  # -1 where a row proposes fewer than K
        rejected = (sampled[:, :-1] != drafts).to(torch.int32)
        ends = torch.ones_like(rejected[:, :1])  # every row stops at its last position
        accepted = torch.argmax(torch.cat((rejected, ends), dim=1), dim=1)  # first rejection
        return (
            sampled,
            accepted.to(torch.int64) + 1,
            s.token_logprobs.view(rows, tokens),
            s.top_logprob_ids.view(rows, tokens, -1),
            s.top_logprobs.view(rows, tokens, -1),
        )
