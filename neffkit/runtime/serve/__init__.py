"""The OpenAI-compatible HTTP API (vLLM's `entrypoints/openai/`): the server process, the routes,
request bodies parsed into `SamplingParams` and constraints, responses and their chunks, tool-call
and logprob rendering, the access log. May import engine/ and the shared runtime modules; the
only room of the runtime that imports FastAPI or uvicorn."""
