"""Attention on the QuantMLA cache: the "quantmla" implementation transformers calls, and the one latent decode.

    interface.py  the "quantmla" `AttentionInterface` function (latent decode on the cache, SDPA elsewhere)
    paged.py      the "quantmla_paged" function of continuous batching on the paged cache
    decode.py     the latent decode every cache goes through: absorb W_UK, attend the layer's `DecodeView`
                  (`quantmla_hf.ops.decode`: the kernel choice and the custom-op boundary), expand W_UV
    chunk.py      draft-verification chunks (each query with its own recent window)
    state.py      the model's shared state (`QuantMLAState`) and the forward pre-hook that hands it the cache
    masks.py, absorbed.py   the one mask the kernels apply, the reference math
"""
