"""Learning the content and RoPE transforms of one attention module on its captured inputs.

Content: minimise the normalized attention-output error after `o_proj` against the frozen full-precision
teacher (the same module, unquantized), with only the cached latent fake-quantized; the module runs its own
forward with the transformed weights, so the objective is exactly what the fused model computes.
RoPE: minimise the normalized positional-QK error of the real (transformed, compensated) queries against the
fake-quantized transformed keys over all causal pairs and heads; the content path is not involved.
Both: Adam on the transform parameters, the start chosen among candidates (identity, Hadamard, SmoothQuant
scales) by the training objective, and the parameters kept from the step with the lowest held-out objective
(step 0 included, so the result is never worse than its start on held-out windows).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from quantmla_hf.format import PathFormat

from .capture import AttentionRunner, LatentHook
from .fusion import content_weights, original_weights, query_projection
from .objectives import fake_quantize, output_nmse, positional_qk_sums, query_grams
from .protection import dual_history, dual_history_mask
from .transforms import ContentTransform, RopeLayout, RopeTransform, apply_family_rope


@dataclass
class LearnSettings:
    """Optimisation settings of one path (see docs/CALIBRATION.md for the defaults)."""

    steps: int = 100
    lr: float = 5e-3
    eval_every: int = 10
    seed: int = 0
    sink: int = 0
    recent: int = 0

    @property
    def protected(self) -> bool:
        """True when the objectives model the cache's sink/recent protection (`protection.py`)."""
        return self.sink > 0 or self.recent > 0


@dataclass
class PathReport:
    """What learning did on one path of one layer (objective values are normalized errors).

    Attributes:
        start: the chosen starting candidate.
        candidates: training objective of every candidate start.
        heldout_rtn: held-out objective with no transform (plain RTN).
        heldout_start: held-out objective at the chosen start.
        heldout_best: held-out objective of the kept parameters.
        best_step: optimisation step of the kept parameters (0 = the start).
        train_start, train_best: objective on all training windows at the start and with the kept parameters.
        selected: what was fused: "learned", or the name of a candidate start that did better on held-out windows.
        curve: training objective of every step's batch.
    """

    start: str = ""
    candidates: dict = field(default_factory=dict)
    heldout_rtn: float = float("nan")
    heldout_start: float = float("nan")
    heldout_best: float = float("nan")
    best_step: int = 0
    train_start: float = float("nan")
    train_best: float = float("nan")
    selected: str = ""
    curve: list = field(default_factory=list)

    def to_dict(self, curve: bool = False) -> dict:
        d = asdict(self)
        if not curve:
            d.pop("curve")
        return d


def _optimise(transform: torch.nn.Module, step_loss: Callable, heldout: Callable, settings: LearnSettings,
              report: PathReport) -> None:
    """Adam on `transform`; keeps the parameters with the lowest held-out objective (evaluated every
    `eval_every` steps and at the end), then loads them into `transform`."""
    best_value, best_state = heldout(), copy.deepcopy(transform.state_dict())
    report.heldout_start, report.best_step = best_value, 0
    opt = torch.optim.Adam(transform.parameters(), lr=settings.lr)
    losses = []  # on the device: read back once at the end, so the steps between evaluations queue without waiting
    for step in range(1, settings.steps + 1):
        with torch.enable_grad():
            loss = step_loss(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        losses.append(loss.detach())
        if step % settings.eval_every == 0 or step == settings.steps:
            value = heldout()
            if value < best_value:
                best_value, best_state, report.best_step = value, copy.deepcopy(transform.state_dict()), step
    report.curve.extend(torch.stack(losses).float().tolist() if losses else [])
    transform.load_state_dict(best_state)
    report.heldout_best = best_value


def _keep_best(trained: torch.nn.Module, starts: dict, heldouts: dict, report: PathReport) -> torch.nn.Module:
    """The trained transform, unless an untrained candidate start does better on the held-out windows."""
    name = min(heldouts, key=heldouts.get)
    if heldouts[name] < report.heldout_best and starts[name] is not trained:
        report.selected, report.heldout_best = name, heldouts[name]
        return starts[name]
    report.selected = "learned" if report.best_step else report.start
    return trained


def _batches(rows: torch.Tensor, size: int):
    return [rows[i : i + size] for i in range(0, rows.numel(), size)]


def _ratio(sums: list) -> float:
    """`sum(num) / sum(den)` of per-batch `(num, den)` device scalars, summed in fp64 on the device and read back
    once (one synchronisation per evaluation, not two per batch); 0 with no batch."""
    if not sums:
        return 0.0
    num = torch.stack([n.double() for n, _ in sums]).sum()
    den = torch.stack([d.double() for _, d in sums]).sum()
    return float(num / den.clamp_min(1e-30))


def _sampler(train: torch.Tensor, size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def sample(step: int) -> torch.Tensor:
        return train[torch.randperm(train.numel(), generator=gen)[: min(size, train.numel())]]

    return sample


@torch.no_grad()
def teacher_outputs(runner: AttentionRunner) -> torch.Tensor:
    """Full-precision attention outputs `[N, T, hidden]` of the module on all captured windows."""
    return torch.cat([runner(h) for _, h in runner.inputs.batches()], 0)


class ContentLearner:
    """Content-path objective and learning for one module.

    Args:
        runner: replays the module on its captured inputs.
        teacher: `[N, T, hidden]` full-precision outputs.
        fmt: the content path format (bits, group).
        sink, recent: the cache's protection to model (0, 0: every cached token quantized). With protection, each
            query reads the quantized latent only of the keys the cache would hold quantized for it
            (`protection.py`), so the objective weighs the errors that inference actually sees.
    """

    def __init__(self, runner: AttentionRunner, teacher: torch.Tensor, fmt: PathFormat, sink: int = 0,
                 recent: int = 0):
        self.runner, self.teacher, self.fmt = runner, teacher, fmt
        self.sink, self.recent = sink, recent
        self.base = original_weights(runner.module, runner.dtype)
        T = runner.inputs.hidden.shape[1]
        self.mask = None
        if sink > 0 or recent > 0:
            self.mask = dual_history_mask(T, sink, recent, runner.dtype, runner.inputs.hidden.device)

    def _hook(self) -> LatentHook:
        if self.mask is None:
            return LatentHook(lambda latent, k_rot: (fake_quantize(latent, self.fmt), k_rot))
        return LatentHook(lambda latent, k_rot: dual_history(latent, k_rot, fake_quantize(latent, self.fmt), k_rot))

    def loss_sums(self, rotation: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor):
        """`(sum |err|^2, sum |teacher|^2)` on windows `rows`, differentiable in `rotation`, `scale`."""
        overrides = content_weights(self.runner.module, rotation, scale, self.base)
        h = self.runner.inputs.select(rows)
        out = self.runner(h, overrides, self._hook(), attention_mask=self.mask)
        ref = self.teacher[rows.to(self.teacher.device)]
        return (out - ref).pow(2).sum(), ref.pow(2).sum()

    @torch.no_grad()
    def objective(self, rotation: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> float:
        sums = [self.loss_sums(rotation, scale, batch) for batch in _batches(rows, self.runner.inputs.batch_size)]
        return _ratio(sums)

    def learn(self, candidates: dict, train: torch.Tensor, held: torch.Tensor, settings: LearnSettings):
        """Learn from the best of `candidates` (name -> `(R0 [d_c, d_c], s0 [d_c])`, first = identity).

        Returns `(rotation [d_c, d_c], scale [d_c], PathReport)`.
        """
        report = PathReport()
        device = self.base["kv_b_proj.weight"].device
        starts = {name: ContentTransform(r0, s0).to(device) for name, (r0, s0) in candidates.items()}
        report.candidates = {name: self.objective(t.rotation(), t.scale(), train) for name, t in starts.items()}
        heldouts = {name: self.objective(t.rotation(), t.scale(), held) for name, t in starts.items()}
        report.start = min(report.candidates, key=report.candidates.get)
        report.train_start = report.candidates[report.start]
        report.heldout_rtn = heldouts[next(iter(starts))]
        transform = starts[report.start]
        sample = _sampler(train, self.runner.inputs.batch_size, settings.seed)

        def step_loss(step):
            num, den = self.loss_sums(transform.rotation(), transform.scale(), sample(step))
            return num / den.clamp_min(1e-30)

        _optimise(transform, step_loss, lambda: self.objective(transform.rotation(), transform.scale(), held),
                  settings, report)
        transform = _keep_best(transform, starts, heldouts, report)
        with torch.no_grad():
            rotation, scale = transform.rotation(), transform.scale()
        report.train_best = self.objective(rotation, scale, train)
        return rotation, scale, report


@dataclass
class ReferenceStreams:
    """What the full-precision module computes on all captured windows, from one replay of each batch.

    Attributes:
        outputs: `[N, T, hidden]` attention outputs (the content objective's teacher), or None when not kept.
        q: `[N, H, T, d_R]` post-RoPE queries; k: `[N, T, d_R]` the post-RoPE keys the module caches.
        latent_max: `[d_c]` per-channel max |c| of the cached latent (the SmoothQuant statistic).
    """

    outputs: torch.Tensor | None
    q: torch.Tensor
    k: torch.Tensor
    latent_max: torch.Tensor


@torch.no_grad()
def reference_streams(runner: AttentionRunner, kind: str, outputs: bool = True) -> ReferenceStreams:
    """The module's outputs, RoPE queries and keys and latent maxima on all captured windows, one replay per batch.

    The keys are what the module hands its cache; the queries are computed with the module's own projections and
    its family's RoPE function, checked against the cached keys (same function applied to both).
    """
    m, p = runner.module, runner.params
    d_c, d_nope, d_r = m.kv_a_layernorm.weight.numel(), m.qk_nope_head_dim, m.qk_rope_head_dim
    qs, ks, outs = [], [], []
    latent_max = torch.zeros(d_c, device=runner.inputs.hidden.device)
    for rows, h in runner.inputs.batches():
        hook = LatentHook()
        out = runner(h, None, hook)
        if outputs:
            outs.append(out)
        latent_max = torch.maximum(latent_max, hook.latent.abs().flatten(0, -2).amax(0).float())
        if getattr(m, "q_proj", None) is not None:
            q = torch.nn.functional.linear(h, p["q_proj.weight"], p.get("q_proj.bias"))
        else:
            qa = torch.nn.functional.linear(h, p["q_a_proj.weight"], p.get("q_a_proj.bias"))
            qa = torch.func.functional_call(m.q_a_layernorm, {"weight": p["q_a_layernorm.weight"]}, (qa,))
            q = torch.nn.functional.linear(qa, p["q_b_proj.weight"])
        b, T = h.shape[:2]
        q_pre = q.view(b, T, -1, d_nope + d_r).transpose(1, 2)[..., d_nope:] * getattr(m, "mla_scale_q_lora", 1.0)
        kv = torch.nn.functional.linear(h, p["kv_a_proj_with_mqa.weight"], p.get("kv_a_proj_with_mqa.bias"))
        k_pre = kv[..., d_c:].reshape(b, 1, T, d_r)
        pe = runner.inputs.kwargs.get("position_embeddings")
        if pe is None:
            raise ValueError(f"{type(m).__name__} was called without position_embeddings; cannot rebuild its RoPE")
        pe = tuple(t[:b] for t in pe) if isinstance(pe, tuple) else pe[:b]
        q_post, k_post = apply_family_rope(m, kind, q_pre, k_pre, pe)
        if not torch.allclose(k_post, hook.k_rot, rtol=1e-4, atol=1e-5 * float(hook.k_rot.abs().max())):
            raise RuntimeError(
                f"the RoPE layout {kind!r} does not reproduce the keys {type(m).__name__} caches; "
                "this family's RoPE is not supported by the RoPE transform"
            )
        qs.append(q_post.float())
        ks.append(hook.k_rot[:, 0].float())
    return ReferenceStreams(torch.cat(outs, 0) if outputs else None, torch.cat(qs, 0), torch.cat(ks, 0), latent_max)


class RopeLearner:
    """RoPE-path objective and learning: positional-QK error of the transformed queries and quantized keys.

    Args:
        q: `[N, H, T, d_R]` post-RoPE queries; k: `[N, T, d_R]` post-RoPE keys.
        layout: the family's pair layout; fmt: the RoPE path format; batch_size: windows per step.
        sink, recent: the cache's protection to model: the error counts only over the (query, key) pairs the cache
            holds quantized (the denominator stays over all causal pairs); 0, 0 counts every causal pair.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, layout: RopeLayout, fmt: PathFormat, batch_size: int,
                 sink: int = 0, recent: int = 0):
        self.k, self.layout, self.fmt, self.batch_size = k, layout, fmt, batch_size
        # The queries enter the objective only through their per-key Gram matrices ([N, T, d_R, d_R] each, computed
        # once: the transform acts on the key error instead, `RopeTransform.inverse_key`).
        # The denominator (`sum (q . k)^2` over causal pairs) does not depend on the transform: one number per window.
        grams, den = [], []
        with torch.no_grad():
            for i in range(0, q.shape[0], batch_size):
                error, causal = query_grams(q[i : i + batch_size], sink, recent)
                for w in range(error.shape[0]):
                    kw = k[i + w : i + w + 1]
                    den.append(positional_qk_sums(kw, kw, causal[w : w + 1], causal[w : w + 1])[1])
                grams.append(error)
        self.grams, self.den = torch.cat(grams, 0), torch.stack(den)

    def loss_sums(self, transform: RopeTransform, rows: torch.Tensor):
        """`(numerator, denominator)` of the objective on windows `rows`, through the queries' per-key Gram matrices
        (`objectives.positional_qk_sums`: the sums of `positional_qk_nmse` without its `[B, H, T, T]` scores)."""
        rows = rows.to(self.k.device)
        k_t = transform.apply(self.k[rows], query=False)
        e = transform.inverse_key(k_t - fake_quantize(k_t, self.fmt)).float()
        return ((e.unsqueeze(-2) @ self.grams[rows]).squeeze(-2) * e).sum(), self.den[rows].sum()

    @torch.no_grad()
    def objective(self, transform: RopeTransform, rows: torch.Tensor) -> float:
        return _ratio([self.loss_sums(transform, batch) for batch in _batches(rows, self.batch_size)])

    def learn(self, candidates: dict, train: torch.Tensor, held: torch.Tensor, settings: LearnSettings):
        """Learn from the best of `candidates` (name -> key scale `[d_R / 2]`, first = identity).

        Returns `(theta [d_R / 2], scale [d_R / 2], PathReport)`.
        """
        device = self.k.device
        starts = {name: RopeTransform(self.layout, s0).to(device) for name, s0 in candidates.items()}
        report = PathReport()
        report.candidates = {name: self.objective(t, train) for name, t in starts.items()}
        report.start = min(report.candidates, key=report.candidates.get)
        report.train_start = report.candidates[report.start]
        heldouts = {name: self.objective(t, held) for name, t in starts.items()}
        report.heldout_rtn = heldouts[next(iter(starts))]
        transform = starts[report.start]
        sample = _sampler(train, self.batch_size, settings.seed + 1)

        def step_loss(step):
            num, den = self.loss_sums(transform, sample(step))
            return num / den.clamp_min(1e-30)

        _optimise(transform, step_loss, lambda: self.objective(transform, held), settings, report)
        transform = _keep_best(transform, starts, heldouts, report)
        report.train_best = self.objective(transform, train)
        return transform.theta.detach().clone(), transform.scale().detach().clone(), report


__all__ = ["ContentLearner", "LearnSettings", "PathReport", "ReferenceStreams", "RopeLearner", "query_projection",
           "reference_streams", "teacher_outputs", "output_nmse"]
