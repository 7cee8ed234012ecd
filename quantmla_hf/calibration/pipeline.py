"""`calibrate`: learn and fuse the QuantMLA transforms of a model, one decoder layer at a time (resumable)."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from ..attention.state import mla_attention_modules
from ..config import QuantMLAConfig
from ..distributed import check_not_sharded_for_calibration
from ..format import CacheFormat
from ..log import get_logger
from ..mla import mla_dims, text_config
from .baselines import hadamard_content, smooth_content, smooth_rope
from .capture import AttentionRunner, capture_inputs, capture_within, decoder_layers, module_device, propagate
from .checkpoint import CalibrationCheckpoint, fingerprint
from .defaults import calibration_data_or_default, resolve_transform
from .fusion import fuse_content, fuse_rope
from .learn import ContentLearner, LearnSettings, RopeLearner, reference_streams
from .offload import materialized
from .plan import SHORT_RECIPE, cost_line, default_batch, estimate_seconds, short_recipe_hint, timed_step
from .protection import quantized_fraction
from .threads import cpu_threads, retune
from .tokens import token_stream
from .transforms import rope_kind, rope_layout, start_rotations

logger = get_logger(__name__)

HELDOUT_FRACTION = 0.1
MIN_QUANTIZED_PAIR_FRACTION = 0.25


def calibration_token_ids(data, tokenizer, samples: int, seq_len: int, seed: int, vocab_size: int | None = None):
    """Token windows `[N, T]` (int64) from `data`: token ids `[N, T]`, a list of strings or a text-file path.

    Text is joined with blank lines, tokenized in bounded pieces (`tokens.token_stream`) and cut into non-overlapping
    `seq_len` windows, of which `samples` are drawn with `seed` (all of them when fewer exist; at least 2 are needed,
    one to hold out).
    """
    if isinstance(data, torch.Tensor):
        if data.is_floating_point() or data.is_complex():
            if not torch.isfinite(data).all():
                raise ValueError("calibration_data contains NaN or inf; pass integer token ids [N, T]")
            raise ValueError(f"calibration_data as a tensor must hold integer token ids [N, T], got dtype {data.dtype}")
        if data.dim() != 2 or data.shape[0] < 2:
            raise ValueError(f"calibration token ids must be [N, T] with N >= 2, got {tuple(data.shape)}")
        if vocab_size is not None and (int(data.min()) < 0 or int(data.max()) >= vocab_size):
            raise ValueError(f"calibration token ids must lie in [0, {vocab_size}), got [{int(data.min())}, "
                             f"{int(data.max())}]; tokenize the calibration text with this model's tokenizer")
        return data.long()
    if isinstance(data, (str, os.PathLike)):
        if not os.path.isfile(data):
            raise ValueError(f"calibration_data {str(data)!r} is not a file; pass a text-file path, a list of strings or token ids")
        with open(data, encoding="utf-8") as f:
            data = [f.read()]
    if not isinstance(data, (list, tuple)) or not data or not all(isinstance(t, str) for t in data):
        raise ValueError("calibration_data must be token ids [N, T], a non-empty list of strings or a text-file path")
    if tokenizer is None:
        raise ValueError("calibration_data given as text needs a tokenizer: calibrate(model, config, texts, tokenizer=tok)")
    ids = token_stream(list(data), tokenizer)
    n = ids.numel() // seq_len
    if n < 2:
        raise ValueError(f"calibration text gives {ids.numel()} tokens, fewer than 2 windows of calibration_seq_len={seq_len}; "
                         "pass more text or lower calibration_seq_len")
    windows = ids[: n * seq_len].view(n, seq_len)
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: min(samples, n)]
    return windows[pick.sort().values]


def _check_finite_weights(module: torch.nn.Module) -> None:
    for name, p in module.named_parameters():
        if p.device.type != "meta" and not torch.isfinite(p).all():
            raise ValueError(f"weight {name} of attention layer {module.layer_idx} contains NaN or inf; the checkpoint "
                             "is corrupt or was cast to a dtype that overflows")


def _split(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    held = max(1, round(HELDOUT_FRACTION * n))
    idx = torch.arange(n)
    return idx[: n - held], idx[n - held :]


def protection_to_model(protection: str, seq_len: int, sink: int, recent: int) -> tuple[int, int, str]:
    """`(sink, recent, why)`: the protection the objectives model for `calibration_protection=protection`.

    "on": the cache's `sink`/`recent`; "off": none (every cached token quantized, the paper's ablation setting);
    "auto": the cache's when at least `MIN_QUANTIZED_PAIR_FRACTION` of a window's causal pairs read a quantized key
    (so the objective still sees enough quantized history), else none.
    """
    if protection not in ("auto", "on", "off"):
        raise ValueError(f"calibration_protection must be 'auto', 'on' or 'off', got {protection!r}")
    if protection == "off" or (sink == 0 and recent == 0):
        return 0, 0, "off" if protection == "off" else "the cache protects no token"
    fraction = quantized_fraction(seq_len, sink, recent)
    if protection == "on":
        if fraction == 0:
            raise ValueError(f"advanced calibration_seq_len={seq_len} leaves no quantized pair with "
                             f"sink_tokens={sink}, recent_tokens={recent}; use longer windows or "
                             "calibration_protection='off'")
        return sink, recent, "on"
    if fraction < MIN_QUANTIZED_PAIR_FRACTION:
        return 0, 0, (f"auto: off, windows of {seq_len} tokens leave only {fraction:.0%} of the pairs quantized "
                      f"under sink {sink} + recent {recent}")
    return sink, recent, f"auto: on ({fraction:.0%} of the pairs quantized)"


def calibrate(model: torch.nn.Module, quantization_config: QuantMLAConfig | dict | None = None, calibration_data=None,
             tokenizer=None, *, batch_size: int | None = None, progress: bool = True,
             calibration_protection: str = "auto", checkpoint_dir: str | os.PathLike | None = None) -> torch.nn.Module:
    """Calibrate the cache transform of `quantization_config.transform` and fuse it into `model`'s weights.

    Decoder layer by decoder layer: the hidden states entering layer `k` (`[N, T, hidden]`, in the model's dtype)
    are the only activations kept between layers; each of the layer's MLA attention modules is captured from them,
    calibrated (fp32) and fused, then the layer is run on them to give layer `k + 1`'s inputs.

    Before learning starts the log says the tokens, windows, steps, layers, threads and an estimated time
    (`plan.cost_line`; on a CPU also a shorter recipe and what it cost in accuracy); on a CPU torch's thread count is
    measured, and measured again between layers (`quantmla_hf.calibration.threads`).

    Args:
        model: a transformers MLA model (any supported family); its weights change in place.
        quantization_config: `QuantMLAConfig` (or its dict); `calibrated` and `extra["calibration"]` are set.
            `transform="auto"` is resolved here (`defaults.resolve_transform`) and written back.
        calibration_data: token ids `[N, T]`, a list of strings or a text-file path (strings need `tokenizer`);
            defaults to `quantization_config.calibration_data`, then (with a tokenizer) to the package's default
            text (`defaults.default_calibration_text`). Not needed for "none" and "hadamard".
        batch_size: calibration windows per forward and per optimisation step; None: `plan.default_batch` of the
            device the first attention module is on (4 on a CPU, 8 on an accelerator).
        progress: a tqdm bar over decoder layers with its ETA (also off when transformers' progress bars are
            disabled, `transformers.utils.logging.disable_progress_bar()`).
        calibration_protection: whether the objectives model the cache's sink/recent protection ("on": a query
            reads the quantized copy only of the keys the cache holds quantized for it; "off": every cached token
            quantized; "auto": on when the calibration windows are long enough, see `protection_to_model`).
        checkpoint_dir: where to keep the transforms of finished layers (`checkpoint.py`); a run interrupted
            (killed, out of memory) and started again on the original weights with the same directory, data and
            settings resumes after the last finished layer.

    Returns:
        `model`, whose fused weights compute the same full-precision function and cache the transformed paths.
    """
    cfg = quantization_config if quantization_config is not None else QuantMLAConfig()
    cfg = QuantMLAConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg
    if cfg.calibrated:
        return model
    if getattr(model, "_quantmla_partially_fused", None) is not None:
        raise ValueError(f"this model's attention weights were partly fused by a calibration that stopped in decoder "
                         f"layer {model._quantmla_partially_fused}; reload the original weights and calibrate again "
                         "(with the same checkpoint_dir to resume from the last finished layer)")
    data = calibration_data if calibration_data is not None else cfg.calibration_data
    if cfg.transform == "auto":  # counts the default text when no text is given (and says so)
        cfg.transform, cfg.extra["transform_choice"] = resolve_transform("auto", data, tokenizer)
    if data is None and cfg.transform in ("smooth", "learned") and tokenizer is not None:
        data, source = calibration_data_or_default(cfg.transform, data)
        cfg.extra.setdefault("calibration_source", source)
    if cfg.transform != "none":
        check_not_sharded_for_calibration(model, cfg.transform)  # tensor parallel: calibrate in one process
    mla_dims(model.config)  # not an MLA model: say so
    modules = mla_attention_modules(model)
    for m in modules:
        with materialized(m):
            _check_finite_weights(m)
    record = {"transform": cfg.transform, "layers": []}
    if cfg.transform == "hadamard":
        for m in modules:
            with materialized(m):
                fuse_content(m, *hadamard_content(m.kv_a_layernorm.weight.detach()))
    elif cfg.transform in ("smooth", "learned"):
        if data is None:
            raise ValueError(f"transform={cfg.transform!r} needs calibration_data (token ids, strings or a text file) "
                             "or a tokenizer to calibrate on the default text")
        device = module_device(modules[0])
        batch_size = batch_size or default_batch(device)
        recipe = cfg.advanced
        ids = calibration_token_ids(data, tokenizer, recipe.calibration_samples, recipe.calibration_seq_len,
                                    recipe.seed, getattr(text_config(model.config), "vocab_size", None))
        sink, recent, why = protection_to_model(calibration_protection, ids.shape[1], cfg.sink_tokens,
                                                cfg.recent_tokens)
        train, held = _split(ids.shape[0])
        record.update(windows=list(ids.shape), heldout_windows=int(held.numel()), steps=recipe.calibration_steps,
                      lr=recipe.calibration_lr, batch_size=batch_size, protection_modelled=[sink, recent],
                      protection=why)
        checkpoint = None
        if checkpoint_dir is not None:
            options = {"transform": cfg.transform, "content_bits": cfg.content_bits, "rope_bits": cfg.rope_bits,
                       "group_size": cfg.group_size, "calibration_steps": recipe.calibration_steps,
                       "calibration_lr": recipe.calibration_lr, "seed": recipe.seed}
            checkpoint = CalibrationCheckpoint(checkpoint_dir, fingerprint(
                model.config, {**options, "batch_size": batch_size,
                               "protection_modelled": [sink, recent]}, ids))
        was_training = model.training
        model.eval()
        try:
            with cpu_threads(device) as threads:
                _calibrate_layers(model, cfg, modules, ids, record, checkpoint, batch_size, progress, threads,
                                  LearnSettings(steps=recipe.calibration_steps, lr=recipe.calibration_lr,
                                               seed=recipe.seed, sink=sink, recent=recent), train, held)
        finally:
            model.train(was_training)
    cfg.calibrated = True
    cfg.extra["calibration"] = record
    return model


def _calibrate_layers(model, cfg: QuantMLAConfig, modules: list, ids: torch.Tensor, record: dict,
                      checkpoint: CalibrationCheckpoint | None, batch_size: int, progress: bool, threads: int,
                      settings: LearnSettings, train: torch.Tensor, held: torch.Tensor) -> None:
    """The layer loop of `calibrate` for "learned" and "smooth": capture, learn, fuse, propagate; says what it will
    cost (`plan.cost_line`) once the first module to learn is captured."""
    dims = mla_dims(model.config)
    fmt = CacheFormat.from_config(dims.kv_lora_rank, dims.rope_dim, cfg)
    layout, kind = rope_layout(model.config, dims.rope_dim), rope_kind(model.config)
    layers = decoder_layers(model, modules)
    to_learn = len(layers) - (checkpoint.finished() if checkpoint is not None else 0)
    show = progress and logging.is_progress_bar_enabled()
    bar = tqdm(total=len(layers), desc=f"QuantMLA {cfg.transform} {cfg.name}", unit="layer", disable=not show)
    layer_inputs = capture_inputs(model, layers[0][0], ids, batch_size, dtype=None)
    fused_any, announced = False, False
    if to_learn <= 0:
        logger.warning(f"calibration: all {len(layers)} decoder layers resumed from {checkpoint.dir}")
    device = module_device(modules[0])
    for index, (layer, attention) in enumerate(layers):
        saved = checkpoint.load(index) if checkpoint is not None else None
        if index:
            threads = retune(device)  # a shared machine's load changes between layers
        inside = {id(sub) for m in attention for sub in m.modules()}
        # The layer's offloaded weights (if any) come to the GPU once for capture, learning and propagation;
        # only its attention modules' (fused) weights go back to the offload map.
        with materialized(layer, write_back=lambda sub: id(sub) in inside):
            try:
                if saved is not None:
                    for m, item in zip(attention, saved, strict=True):
                        fused_any = True
                        with materialized(m):
                            apply_transforms(m, layout, item["transforms"])
                        record["layers"].append({**item["entry"], "resumed": True})
                else:
                    done = []
                    for m in attention:
                        start = time.perf_counter()
                        inputs = capture_within(layer, layer_inputs, m)
                        with materialized(m):
                            if not announced:
                                announced = True
                                estimate, short = _estimate(m, inputs, fmt, settings, ids.shape, held.numel(),
                                                            cfg.advanced.calibration_steps, len(attention), to_learn) \
                                    if cfg.transform == "learned" else (None, None)
                                record.update(threads=threads, estimated_seconds=estimate and round(estimate, 1))
                                logger.warning(cost_line(record, len(layers), to_learn, threads, estimate,
                                                         short_recipe_hint(cfg, device, short)))
                            entry, transforms = calibrate_module(m, inputs, fmt, layout, kind, cfg.transform,
                                                                 settings, train, held)
                            fused_any = True
                            apply_transforms(m, layout, transforms)
                        del inputs
                        entry.update(layer_idx=int(m.layer_idx), seconds=round(time.perf_counter() - start, 3),
                                     threads=threads)
                        done.append({"transforms": transforms, "entry": entry})
                        record["layers"].append(entry)
                        # A 16-bit path is not learned and has no entry.
                        bar.set_postfix({p: f"{entry[p]['heldout_rtn']:.2e}->{entry[p]['heldout_best']:.2e}"
                                         for p in ("content", "rope") if p in entry})
                    if checkpoint is not None:
                        checkpoint.save(index, done)
                if index + 1 < len(layers):
                    layer_inputs = replace(layer_inputs, hidden=propagate(layer, layer_inputs))
            except BaseException:
                if fused_any:  # the weights in memory are now neither the original nor the calibrated ones
                    model._quantmla_partially_fused = index
                raise
        bar.update(1)
    bar.close()


def _estimate(module, inputs, fmt, settings: LearnSettings, windows: tuple, held: int, steps: int, modules: int,
              layers: int) -> tuple[float, float]:
    """Seconds the calibration of `layers` layers should take, from one timed step of `module` (`plan.timed_step`)
    on `windows` (`(N, T)`), and the same for `plan.SHORT_RECIPE` (the step scaled by its window length)."""
    step = timed_step(AttentionRunner(module, inputs), fmt.content, settings.sink, settings.recent)
    estimate = estimate_seconds(step, windows[0], held, inputs.batch_size, steps, modules, layers)
    n, t = SHORT_RECIPE["calibration_samples"], SHORT_RECIPE["calibration_seq_len"]
    short = estimate_seconds(step * t / windows[1], n, _split(n)[1].numel(), inputs.batch_size,
                             SHORT_RECIPE["calibration_steps"], modules, layers)
    return estimate, short


def apply_transforms(module, layout, transforms: dict) -> None:
    """Fuse the transforms `calibrate_module` returned (`{"content": (rotation, scale), "rope": (theta, scale)}`,
    either absent when its path is not transformed) into `module`'s weights."""
    device = module.kv_a_layernorm.weight.device  # materialised: the transforms are kept on the CPU
    if "content" in transforms:
        fuse_content(module, *(t.to(device) for t in transforms["content"]))
    if "rope" in transforms:
        fuse_rope(module, layout, *(t.to(device) for t in transforms["rope"]))


def calibrate_module(module, inputs, fmt: CacheFormat, layout, kind: str, transform: str, settings: LearnSettings,
                     train: torch.Tensor, held: torch.Tensor) -> tuple[dict, dict]:
    """Calibrate one attention module from its captured inputs: `(record entry, transforms)`; fusing the
    transforms (`apply_transforms`) is left to the caller. The RoPE objective does not depend on the content
    transform, so both are learned from the unfused module."""
    runner = AttentionRunner(module, inputs)
    learn_content = transform == "learned" and fmt.content.quantized
    streams = reference_streams(runner, kind, outputs=learn_content)  # one replay gives every statistic
    q, k = streams.q, streams.k
    w = module.kv_a_layernorm.weight.detach().float()
    if transform == "smooth":
        return {}, {"content": _cpu(smooth_content(streams.latent_max, runner.params["kv_b_proj.weight"], w)),
                    "rope": _cpu((torch.zeros(layout.n_pairs), smooth_rope(q, k, layout)))}
    entry, transforms = {}, {}
    if learn_content:
        learner = ContentLearner(runner, streams, fmt.content, settings.sink, settings.recent)
        candidates = {name: (r0, _start_scale(name, w)) for name, r0 in start_rotations(w).items()}
        candidates["smooth"] = smooth_content(streams.latent_max, runner.params["kv_b_proj.weight"], w)
        rotation, scale, report = learner.learn(candidates, train, held, settings)
        transforms["content"] = _cpu((rotation, scale))
        entry["content"] = report.to_dict()
    del streams
    if fmt.rope.quantized:
        learner = RopeLearner(q, k, layout, fmt.rope, inputs.batch_size, settings.sink, settings.recent)
        starts = {"identity": torch.ones(layout.n_pairs, device=q.device), "smooth": smooth_rope(q, k, layout)}
        theta, scale, report = learner.learn(starts, train, held, settings)
        transforms["rope"] = _cpu((theta, scale))
        entry["rope"] = report.to_dict()
    return entry, transforms


def _cpu(pair) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.detach().float().cpu().contiguous() for t in pair)


def _start_scale(name: str, w: torch.Tensor) -> torch.Tensor:
    if name == "identity":
        return w.abs().clamp_min(1e-8)
    return torch.full_like(w, float(w.pow(2).mean().sqrt().clamp_min(1e-8)))
