"""The ops graphs are built from, as plain torch functions with static shapes and no host syncs.

These are the torch reference implementations every target lowers. Shape letters: B rows
(sequences), T tokens per row, C context tokens attended, H query heads, KV key/value heads,
D head_dim.
"""
