"""The QuantMLA caches: packed low-bit copies of the MLA latent plus model-dtype sink and recent copies.

    growing.py    `QuantMLACache`: a transformers `Cache` whose planes grow in blocks (eager decoding, any device)
    static.py     `StaticQuantMLACache`: every buffer preallocated, lengths on the device (CUDA graphs, compile)
    paged.py      `PagedQuantMLACache`: fixed-size pages shared by many requests (continuous batching)
    store.py      the block-grown planes of one path; allocator.py: the page allocator of the paged cache

Each cache layer hands the decode a `DecodeView` (`quantmla_hf.ops.decode`): its planes or page pools, copies and
lengths.
"""
