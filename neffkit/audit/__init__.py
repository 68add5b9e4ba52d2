"""Hazard rules on traced graphs, their flags and (neuron) their HLO: used by `build` on fresh
traces and by `inspect` on shipped bundles. rules.py holds the ids, graph.py what the rules read,
checks.py the rules, hlo.py the HLO module's parser and rules.
"""
