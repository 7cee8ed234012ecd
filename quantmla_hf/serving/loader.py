"""The pieces of transformers' server (from 5.25 on) that `quantmla serve` replaces, for QuantMLA checkpoints only:

- `PagedModelLoader`: transformers' model loader (pickled into the process that runs the model), whose models
  generate with continuous batching on the paged packed cache (`manager.PagedBatchingManager`);
- `PagedGenerationState`: transformers' generation settings, with the longest request the paged cache holds as the
  context length the handlers check prompts against (a 400 before anything streams).
"""

from __future__ import annotations

import torch
from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import GenerationState

from .continuous_api import SERVE_OPTIONS
from .manager import CacheOptions, quantmla_config_of, request_token_limit


class PagedModelLoader(ModelLoader):
    """transformers' model loader, for QuantMLA checkpoints only: the loaded model generates with continuous
    batching on the paged packed cache (`PagedBatchingManager`, sized and warmed by `options`)."""

    def __init__(self, options: CacheOptions, device: str = "auto", dtype: str = "auto"):
        super().__init__(device=device, dtype=dtype)
        self.options = options

    def load_model_and_processor(self, model_id: str, on_progress=None):
        model, processor = super().load_model_and_processor(model_id, on_progress=on_progress)
        quantmla_config_of(model)  # refuse a model the packed cache cannot serve
        # Its `init_continuous_batching` (`quantmla_hf.hooks`) then returns the manager of these options.
        setattr(model, SERVE_OPTIONS, (self.options, getattr(processor, "tokenizer", processor)))
        return model, processor

    def model_dtype(self, config) -> torch.dtype:
        """The dtype the model of `config` loads in: the server's `--dtype`, else the checkpoint's (`"auto"`)."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        dtype = getattr(config, "dtype", None)
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        return dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()

    def request_limit(self, config) -> int:
        """The most tokens one request holds, prompt and answer, on the cache `options` give this model."""
        return request_token_limit(config, self.options, self.model_dtype(config))


class PagedGenerationState(GenerationState):
    """Continuous batching for every model, with the longest request the paged cache holds as the context length
    (the handlers refuse a prompt that leaves no room for an answer in it: a 400, streaming or not)."""

    def __init__(self, loader: PagedModelLoader):
        super().__init__(continuous_batching=True)
        self.loader = loader

    def context_length(self, config) -> int | None:
        context = super().context_length(config)
        limit = self.loader.request_limit(config)
        return limit if context is None else min(context, limit)
