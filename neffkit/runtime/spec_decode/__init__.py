"""Speculative decoding's proposers (vLLM's `v1/spec_decode/`): prompt lookup (n-gram), a draft
model's graphs and DeepSeek's MTP layer, behind the batch-proposer protocol the engine calls, and
the per-row back-off policy. The engine hands them the rows and step outputs they need: they may
import worker/ and the shared runtime modules, never engine/ or serve/."""
