"""The neuron target: lowering to HLO (lower.py), neuronx-cc (neuronx_cc.py), the backend the build
calls (backend.py), and `neffkit compile`, which finishes a lowered bundle on a Neuron host
(finish.py). Nothing here imports a Neuron package; this file imports nothing, so `finish` runs
without the lowering stack.
"""
