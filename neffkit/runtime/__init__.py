"""The serving side: open a bundle, schedule requests over its graphs, serve them.

Four rooms, named as vLLM v1 names them, with imports flowing one way:

    serve/ ──► engine/ ──► spec_decode/ ──► worker/ ──► config, sampling_params, tokenizer

- `serve/`: the OpenAI-compatible HTTP API: routes, request parsing, tool and logprob rendering,
  the access log. The only room that imports FastAPI.
- `engine/`: the engine core and its client, the scheduler, the KV block pool and prefix cache,
  request limits, structured-output grammars, metrics, offline generation (`LLM`).
- `spec_decode/`: the proposers (n-gram, draft model, MTP) behind one protocol the engine calls;
  the engine hands them the rows and step outputs they need.
- `worker/`: one rank's graphs: the loader, executors, the model runner and its graph inputs,
  the batches it is handed, the follower ranks.

Beside the rooms: `config.py` (what a bundle can serve, a view of its layout),
`sampling_params.py` and `tokenizer.py`, which every room reads and which import no room.
Nothing here imports neffkit.compile or neffkit.models, or torch._dynamo or torch._inductor
(tests/unit/test_layering.py enforces all of this).
"""
