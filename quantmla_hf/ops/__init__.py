"""The operations over the kernels in `kernels/` that the caches and the attention call:

    decode.py     the one decode entry: a cache layer's `DecodeView` in, the latent-space attention out (kernel or
                  reference, contiguous or paged, the custom op `torch.compile` traces); the native-chunk rule
    backends.py   which kernel runs (the backend table `select_backend`), its split plan and launch
    write.py      the quantize-and-pack writes of the caches, and the static cache's write as a custom op
"""
