"""The engine (vLLM's `v1/engine/` and `v1/core/`): the engine core process and the client the
server talks to, the scheduler and its KV block pool with prefix caching, request limits checked
against the bundle, structured-output grammars, metrics, detokenizing with stop strings, and
offline generation. May import spec_decode/, worker/ and the shared runtime modules; never
serve/ or an HTTP library."""
