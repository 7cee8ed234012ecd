"""Continuous batching on the paged QuantMLA cache, and `quantmla serve`.

    batching.py        `ContinuousBatcher`: requests of different lengths stepped together on the paged cache
    graphs.py          captured decode-only steps of the batcher
    manager.py         the batcher behind the manager interface transformers' server and `generate_batch` drive
    continuous_api.py  `model.generate_batch` / `init_continuous_batching` of a QuantMLA model
    server.py, loader.py   `quantmla serve`: transformers' OpenAI-compatible server on that manager
"""
