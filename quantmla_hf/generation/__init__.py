"""How `generate()` runs on a QuantMLA model: the cache it builds, and decode steps replayed from CUDA graphs
(reached through the overrides in `quantmla_hf/hooks.py`).

    plan.py       which cache a call gets (growing, static with graphs, static compiled) and its first size
    graphs.py     captured decode steps (`CapturedStep`, `DecodeGraphStep`) and their pools
    segments.py   one graph per device segment under an accelerate device map
"""
