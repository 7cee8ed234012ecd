"""Learning the content and RoPE transforms of one attention module on its captured inputs.

Content: minimise the normalized attention-output error after `o_proj` against the frozen full-precision
teacher (the same module, unquantized), with only the cached latent fake-quantized. The objective is defined by the
module's own forward with the transformed weights (exactly what the fused model computes); learning evaluates the
same sums from what the transform cannot change, computed once per window (`ContentLearner`), checked against that
definition.
RoPE: minimise the normalized positional-QK error of the real (transformed, compensated) queries against the
fake-quantized transformed keys over all causal pairs and heads, through per-key Gram matrices of the queries; the
content path is not involved.
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
from .objectives import (
    attention_partials,
    fake_quantize,
    gram_quadratic,
    output_nmse,
    quantized_pairs_attention,
    query_grams,
)
from .protection import dual_history, dual_history_mask, quantized_pairs
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


@dataclass
class ReferenceStreams:
    """What the full-precision module computes on the captured windows, from one replay of each batch.

    Attributes:
        outputs: `[N, T, hidden]` attention outputs (the content objective's teacher), or None when not kept.
        q: `[N, H, T, d_R]` post-RoPE queries; k: `[N, T, d_R]` the post-RoPE keys the module caches.
        latent_max: `[d_c]` per-channel max |c| of the cached latent (the SmoothQuant statistic).
        q_nope: `[N, H, T, d_nope]` the queries' content part as the module's attention reads it, or None when the
            outputs are not kept.
        normed: `[N, T, d_c]` the normalized latent `n = x_c / rms(x_c)` (the cached latent is `w * n`, times
            LongCat's `mla_scale_kv_lora`), or None when the outputs are not kept.
    """

    outputs: torch.Tensor | None
    q: torch.Tensor
    k: torch.Tensor
    latent_max: torch.Tensor
    q_nope: torch.Tensor | None = None
    normed: torch.Tensor | None = None


@torch.no_grad()
def reference_streams(runner: AttentionRunner, kind: str, outputs: bool = True,
                      index: torch.Tensor | None = None) -> ReferenceStreams:
    """The module's outputs, queries and keys and latent maxima on the captured windows `index` (all by default),
    one replay per batch; with `outputs`, also what the content objective reads (`q_nope`, `normed`).

    The keys are what the module hands its cache; the queries are computed with the module's own projections and
    its family's RoPE function, checked against the cached keys (same function applied to both). Everything is in the
    runner's dtype.
    """
    m, p, dtype = runner.module, runner.params, runner.dtype
    d_c, d_nope, d_r = m.kv_a_layernorm.weight.numel(), m.qk_nope_head_dim, m.qk_rope_head_dim
    q_scale = getattr(m, "mla_scale_q_lora", 1.0)
    unit_norm = {"weight": torch.ones_like(p["kv_a_layernorm.weight"])}
    qs, ks, outs, nopes, normed = [], [], [], [], []
    latent_max = torch.zeros(d_c, device=runner.inputs.hidden.device)
    for rows, h in runner.inputs.batches(index):
        hook = LatentHook()
        out = runner(h, None, hook)
        latent_max = torch.maximum(latent_max, hook.latent.abs().flatten(0, -2).amax(0).float())
        if getattr(m, "q_proj", None) is not None:
            q = torch.nn.functional.linear(h, p["q_proj.weight"], p.get("q_proj.bias"))
        else:
            qa = torch.nn.functional.linear(h, p["q_a_proj.weight"], p.get("q_a_proj.bias"))
            qa = torch.func.functional_call(m.q_a_layernorm, {"weight": p["q_a_layernorm.weight"]}, (qa,))
            q = torch.nn.functional.linear(qa, p["q_b_proj.weight"])
        b, T = h.shape[:2]
        q = q.view(b, T, -1, d_nope + d_r).transpose(1, 2)
        q_pre = q[..., d_nope:] * q_scale
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
        qs.append(q_post.to(dtype))
        ks.append(hook.k_rot[:, 0].to(dtype))
        if outputs:
            outs.append(out)
            nopes.append((q[..., :d_nope] * q_scale).to(dtype))
            normed.append(torch.func.functional_call(m.kv_a_layernorm, unit_norm, (kv[..., :d_c],)).to(dtype))
    cat = lambda xs: torch.cat(xs, 0) if outputs else None  # noqa: E731
    return ReferenceStreams(cat(outs), torch.cat(qs, 0), torch.cat(ks, 0), latent_max, cat(nopes), cat(normed))


class ContentLearner:
    """Content-path objective and learning for one module.

    The objective is the module's own forward with only the cached latent fake-quantized (`module_loss_sums`, its
    definition); learning computes the same sums from what the transform cannot change, kept once per window
    (`loss_sums`). The transform leaves the queries, the RoPE keys, every exact (protected) key and value and the
    normalized latent `n` unchanged: per step only the quantized latent `fq(s * R n)`, its keys and values through the
    transformed `kv_b_proj`, their attention over the quantized pairs and `o_proj` are computed. With protection, a
    query `t` reads quantized keys `sink <= j <= t - recent`: queries `t >= sink + recent` over keys
    `sink <= j < T - recent`, a causal pattern of `T - sink - recent` tokens; the exact keys of each such query enter
    as one precomputed partial softmax (`objectives.attention_partials`, merged by `objectives.quantized_pairs_attention`),
    and the earlier queries, which read no quantized key, have the teacher's output exactly (they contribute nothing
    to the numerator and are left out of it). `tests/test_calibration_protection.py` checks both forms, and their
    gradients, against each other; each learner checks them on its first window before learning.

    Args:
        runner: replays the module on its captured inputs.
        streams: `reference_streams(runner, kind)` of the windows the objective runs on (windows `0 .. N - 1` of the
            runner's inputs), with the outputs (the teacher) kept.
        fmt: the content path format (bits, group).
        sink, recent: the cache's protection to model (0, 0: every cached token quantized). With protection, each
            query reads the quantized latent only of the keys the cache would hold quantized for it
            (`protection.py`), so the objective weighs the errors that inference actually sees.
        block: query rows per attention block (the result does not depend on it).
    """

    CHECK_RTOL = 1e-2  # the two forms differ by float rounding only; a family whose forward differs is off by O(1)

    def __init__(self, runner: AttentionRunner, streams: ReferenceStreams, fmt: PathFormat, sink: int = 0,
                 recent: int = 0, block: int = 128):
        if streams.outputs is None:
            raise ValueError("the content objective needs the teacher: reference_streams(..., outputs=True)")
        self.runner, self.teacher, self.fmt = runner, streams.outputs, fmt
        self.sink, self.recent, self.block = sink, recent, block
        self.base = original_weights(runner.module, runner.dtype)
        m = runner.module
        T = self.teacher.shape[1]
        self.first, self.keys = sink + recent, (sink, T - recent)  # first query that reads a quantized key; key range
        if self.first >= T:
            raise ValueError(f"sink {sink} + recent {recent} leave no quantized pair in windows of {T} tokens; "
                             "calibrate with longer windows or calibration_protection off")
        self.mask = dual_history_mask(T, sink, recent, runner.dtype, runner.inputs.hidden.device) \
            if sink > 0 or recent > 0 else None
        self.scaling, self.kv_scale = float(m.scaling), getattr(m, "mla_scale_kv_lora", 1.0)
        self.heads, self.d_nope, self.d_v = m.num_heads, m.qk_nope_head_dim, m.v_head_dim
        a, z = self.keys
        self.q_nope = streams.q_nope[:, :, self.first :] * self.scaling  # the scores' scale, applied once
        self.q_rot = streams.q[:, :, self.first :]
        self.k_rot = streams.k[:, a:z].unsqueeze(1)
        self.normed = streams.normed[:, a:z]
        self.target = self.teacher[:, self.first :]
        self.den = self.teacher.pow(2).flatten(1).sum(1)
        self.part_out = self.part_lse = None
        if self.mask is not None:
            self.part_out, self.part_lse = self._exact_partials(streams)
        self._check()

    @torch.no_grad()
    def _exact_partials(self, streams: ReferenceStreams):
        """Attention of queries `t >= sink + recent` over their exact (protected) keys, from the original latent:
        `([N, H, T', d_v], [N, H, T'])`, `T' = T - sink - recent`. A block of queries `[t0, t1)` reads the sink keys
        and keys `t0 - recent < j < t1` (the band, not the whole window)."""
        N, T = self.teacher.shape[:2]
        device = self.teacher.device
        exact = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        exact &= ~quantized_pairs(T, self.sink, self.recent, device)
        w = self.base["kv_a_layernorm.weight"]
        n = T - self.first
        out = torch.empty(N, self.heads, n, self.d_v, dtype=self.teacher.dtype, device=device)
        lse = torch.empty(N, self.heads, n, dtype=self.teacher.dtype, device=device)
        for i in range(0, N, self.runner.inputs.batch_size):
            rows = slice(i, i + self.runner.inputs.batch_size)
            k_nope, v = self._expand((w * streams.normed[rows]) * self.kv_scale, self.runner.params["kv_b_proj.weight"])
            k = torch.cat([k_nope, streams.k[rows].unsqueeze(1).expand(-1, self.heads, -1, -1)], -1)
            q = torch.cat([streams.q_nope[rows], streams.q[rows]], -1)
            for t0 in range(self.first, T, self.block):
                t1 = min(T, t0 + self.block)
                keys = torch.cat([torch.arange(self.sink), torch.arange(max(self.sink, t0 - self.recent + 1), t1)])
                keys = keys.to(device)
                block = attention_partials(q[:, :, t0:t1], k[:, :, keys], v[:, :, keys], self.scaling,
                                           exact[t0:t1][:, keys])
                out[rows, :, t0 - self.first : t1 - self.first], lse[rows, :, t0 - self.first : t1 - self.first] = block
        return out, lse

    def _expand(self, latent: torch.Tensor, kv_b: torch.Tensor):
        """`kv_b_proj` of `latent: [b, t, d_c]` split into keys `[b, H, t, d_nope]` and values `[b, H, t, d_v]`."""
        kv = torch.nn.functional.linear(latent, kv_b, self.runner.params.get("kv_b_proj.bias"))
        kv = kv.view(*latent.shape[:2], self.heads, self.d_nope + self.d_v).transpose(1, 2)
        return kv.split([self.d_nope, self.d_v], -1)  # (slices would each fill a zero gradient of kv's size)

    def loss_sums(self, rotation: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor):
        """`(sum |err|^2, sum |teacher|^2)` on windows `rows`, differentiable in `rotation`, `scale` (`[d_c, d_c]`
        orthogonal, `[d_c]` positive); the sums of `module_loss_sums` from the per-window constants."""
        rows = rows.to(self.teacher.device)
        p = self.runner.params
        kv_b = content_weights(self.runner.module, rotation, scale, self.base)["kv_b_proj.weight"]
        latent = ((self.normed[rows] @ rotation.T) * scale) * self.kv_scale
        k_nope, v = self._expand(fake_quantize(latent, self.fmt), kv_b)
        attn = self._attend(rows, k_nope, v)
        out = torch.nn.functional.linear(attn, p["o_proj.weight"], p.get("o_proj.bias"))
        return (out - self.target[rows]).pow(2).sum(), self.den[rows].sum()

    def _attend(self, rows: torch.Tensor, k_nope: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output `[b, T', H * d_v]` of the queries that read quantized keys over those keys (`k_nope`,
        `v`: `[b, H, T', d]`), merged with their exact part; query blocks of `block` rows attend only to the keys up
        to their last row (the causal pattern's upper triangle is not computed)."""
        q_nope = self.q_nope[rows]
        b, h, n = q_nope.shape[:3]
        part = (self.part_out[rows].flatten(0, 1), self.part_lse[rows].flatten(0, 1)) if self.part_out is not None \
            else (None, None)
        attn = quantized_pairs_attention(q_nope.flatten(0, 1), k_nope.reshape(b * h, n, self.d_nope),
                                         v.reshape(b * h, n, self.d_v), self.q_rot[rows], self.k_rot[rows],
                                         self.scaling, *part, block=self.block).view(b, h, n, self.d_v)
        return attn.transpose(1, 2).reshape(b, n, -1)

    def module_loss_sums(self, rotation: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor):
        """The objective's definition: the module's own forward (`torch.func.functional_call` with the transformed
        weights) with the cached latent fake-quantized where the protection says (the doubled history of
        `protection.py`), against the teacher: `(sum |err|^2, sum |teacher|^2)` on windows `rows`."""
        overrides = content_weights(self.runner.module, rotation, scale, self.base)
        if self.mask is None:
            hook = LatentHook(lambda latent, k_rot: (fake_quantize(latent, self.fmt), k_rot))
        else:
            hook = LatentHook(lambda latent, k_rot: dual_history(latent, k_rot, fake_quantize(latent, self.fmt), k_rot))
        out = self.runner(self.runner.inputs.select(rows), overrides, hook, attention_mask=self.mask)
        ref = self.teacher[rows.to(self.teacher.device)]
        return (out - ref).pow(2).sum(), ref.pow(2).sum()

    @torch.no_grad()
    def _check(self) -> None:
        """`loss_sums` against `module_loss_sums` on the first window at the RTN start (signs of `w`, `|w|`)."""
        w = self.base["kv_a_layernorm.weight"]
        rotation, scale = torch.diag(torch.where(w < 0, -1.0, 1.0).to(w.dtype)), w.abs().clamp_min(1e-8)
        first = torch.arange(1)
        fast, slow = self.loss_sums(rotation, scale, first), self.module_loss_sums(rotation, scale, first)
        for a, b in zip(fast, slow):
            if not torch.isclose(a, b, rtol=self.CHECK_RTOL, atol=1e-12 * float(slow[1])):
                raise RuntimeError(
                    f"the content objective computed from per-window constants ({float(fast[0]):.6g}) differs from "
                    f"{type(self.runner.module).__name__}'s own forward ({float(slow[0]):.6g}); its attention is not "
                    "the MLA forward the learner assumes (queries, kv_b_proj keys and values, softmax, o_proj)"
                )

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
        N, T, d = k.shape
        self.grams = torch.empty(N, T, d, d, device=k.device)
        self.den = torch.empty(N, device=k.device)
        with torch.no_grad():
            for i in range(0, N, batch_size):
                error, causal = query_grams(q[i : i + batch_size], sink, recent)
                for w in range(error.shape[0]):
                    self.den[i + w] = gram_quadratic(k[i + w : i + w + 1], causal[w : w + 1])
                self.grams[i : i + error.shape[0]] = error
                del error, causal

    def loss_sums(self, transform: RopeTransform, rows: torch.Tensor):
        """`(numerator, denominator)` of the objective on windows `rows`, through the queries' per-key Gram matrices
        (`objectives.positional_qk_sums`: the sums of `positional_qk_nmse` without its `[B, H, T, T]` scores)."""
        k_t = transform.apply(self.k[rows.to(self.k.device)], query=False)
        e = transform.inverse_key(k_t - fake_quantize(k_t, self.fmt))
        return gram_quadratic(e, self.grams, rows), self.den[rows.to(self.den.device)].sum()

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
           "reference_streams", "output_nmse"]
