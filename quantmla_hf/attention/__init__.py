"""Attention on the QuantMLA cache: the "quantmla" implementation transformers calls, and the one latent decode.

    interface.py  the `AttentionInterface` functions ("quantmla", "quantmla_paged")
    decode.py     the latent decode every cache goes through: absorb W_UK, attend the packed cache, expand W_UV
    backends.py   which kernel runs (the backend table) and its launch; ops.py: the custom op boundary for compile
    chunk.py      draft-verification chunks (each query with its own recent window)
    masks.py, absorbed.py, state.py   the one mask the kernels apply, the reference math, the model's shared state
"""
