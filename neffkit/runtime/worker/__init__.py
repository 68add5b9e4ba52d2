"""One rank's graphs (vLLM's `v1/worker/`): loading and checking a bundle, the executors
(AOTInductor, XLA:CPU, Neuron), the model runner that turns a scheduled batch into graph inputs
by the ABI and the outputs it reads back, the batches and sequence state it is handed, and the
follower ranks of a multi-rank bundle. Imports only the shared runtime modules, the contract and
the platform: never engine/, spec_decode/ or serve/."""
