"""`PagedModelLoader`: transformers' model loader (from 5.25 on, pickled into the process that runs the model) for
QuantMLA checkpoints only, whose models generate with continuous batching on the paged packed cache."""

from __future__ import annotations

from transformers.cli.serving.model_manager import ModelLoader

from .serving import CacheOptions, quantmla_config_of
from .serving_manager import PagedBatchingManager


class PagedModelLoader(ModelLoader):
    """transformers' model loader, for QuantMLA checkpoints only: the loaded model generates with continuous
    batching on the paged packed cache (`PagedBatchingManager`, sized by `options`)."""

    def __init__(self, options: CacheOptions, device: str = "auto", dtype: str = "auto"):
        super().__init__(device=device, dtype=dtype)
        self.options = options

    def load_model_and_processor(self, model_id: str, on_progress=None):
        model, processor = super().load_model_and_processor(model_id, on_progress=on_progress)
        quantmla_config_of(model)  # refuse a model the packed cache cannot serve
        options = self.options
        model.init_continuous_batching = lambda *args, **kwargs: PagedBatchingManager(model, options)
        return model, processor
