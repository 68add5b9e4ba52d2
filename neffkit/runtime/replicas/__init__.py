"""Data-parallel serving (`neffkit run BUNDLE --data-parallel N`): N engine cores, each pinned
to its share of the host's CPUs, behind the one HTTP server: routing by cached prefix, else by
load (routing.py), restarts of a replica that dies (group.py), every metric per engine
(exposition.py)."""
