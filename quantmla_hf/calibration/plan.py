"""What a calibration will run and what it will cost, said before it starts.

`cost_line` is the log line before learning starts: tokens, windows, steps, layers, threads and an estimate from the
median of three timed content steps of the first attention module (`timed_step`) and the work count of the recipe
(`estimate_seconds`).

The recipe is sized for the machine: `default_batch` is 8 windows per step on an accelerator, where a step costs
mostly its launches, and 4 on a CPU, where it costs its arithmetic (half of it; on held-out text 4 tied 8 at C4R4 and
C2R4, docs/ACCURACY.md). On a CPU, when no recipe option was given, the line also offers `SHORT_RECIPE` (advanced
options) with its estimated time and what it was measured to cost in accuracy; it is offered, not taken, since it
lost at C2R4.
"""

from __future__ import annotations

import math
import time

import torch

from .learn import ContentLearner, reference_streams
from .transforms import ContentTransform, rope_kind, start_rotations

SHORT_RECIPE = {"calibration_samples": 32, "calibration_seq_len": 256, "calibration_steps": 50, "calibration_lr": 1e-2}
RECIPE_OPTIONS = tuple(f"advanced.{name}" for name in SHORT_RECIPE)  # as `QuantMLAConfig.explicit_options` names them
# Cost of a forward-only batch, and of a RoPE step, in content steps (forward + backward of one batch): the estimate is
# a count of these units times one timed step. The forward unit also carries each module's setup (the reference
# replay, the learners' constants), which the count leaves out: 0.7 put the estimate within 8% of the measured CPU
# calibrations of the embedded model and the converted SmolLM2 (docs/BENCHMARKS.md, "Calibration on a 2-core CPU").
FORWARD_UNIT = 0.7
ROPE_UNIT = 0.1
ACCELERATOR_BATCH = 8  # windows per step where a step costs its launches
CPU_BATCH = 4  # windows per step where a step costs its arithmetic


def default_batch(device: torch.device | str) -> int:
    """Calibration windows per forward and per learning step when the caller gives none: `CPU_BATCH` on a CPU,
    `ACCELERATOR_BATCH` elsewhere."""
    return CPU_BATCH if torch.device(device).type == "cpu" else ACCELERATOR_BATCH


def short_recipe_hint(config, device: torch.device, seconds: float | None = None) -> str | None:
    """On a CPU with no recipe option given (`QuantMLAConfig.explicit_options`), a sentence offering `SHORT_RECIPE`
    with its estimated `seconds` (when known) and what it was measured to cost in accuracy; None otherwise."""
    if torch.device(device).type != "cpu" or set(getattr(config, "explicit_options", ())) & set(RECIPE_OPTIONS):
        return None
    cost = f" would take about {seconds:.0f} s" if seconds is not None else " is shorter"
    return (f"on a CPU, advanced={SHORT_RECIPE}{cost}; on held-out text it had 1.07x this recipe's KL at C4R4 and "
            "1.22x at C2R4 (docs/ACCURACY.md)")


def timed_step(runner, fmt, sink: int, recent: int, repeats: int = 3) -> float:
    """Seconds of one content learning step (`learn.ContentLearner`: transformed weights, fake-quantized latent,
    forward, backward, Adam) of the module `runner` replays, on its first batch, from the RTN start: the median of
    `repeats` steps. `fmt` is the content path's format, `sink`/`recent` the protection the objective models."""
    module = runner.module
    rows = torch.arange(min(runner.inputs.batch_size, runner.inputs.hidden.shape[0]))
    learner = ContentLearner(runner, reference_streams(runner, rope_kind(module.config), index=rows), fmt, sink, recent)
    teacher = learner.teacher
    w = module.kv_a_layernorm.weight.detach().float()
    transform = ContentTransform(start_rotations(w)["identity"], w.abs().clamp_min(1e-8)).to(teacher.device)
    opt = torch.optim.Adam(transform.parameters(), lr=1e-3)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.enable_grad():
            num, den = learner.loss_sums(transform.rotation(), transform.scale(), rows)
            opt.zero_grad(set_to_none=True)
            (num / den).backward()
            opt.step()
        if teacher.is_cuda:
            torch.cuda.synchronize(teacher.device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def estimate_seconds(step: float, windows: int, held: int, batch: int, steps: int, modules: int, layers: int) -> float:
    """Seconds for `layers` decoder layers of `modules` attention modules each, from one timed `step`.

    Per module: `steps` content steps and `steps` RoPE steps (`ROPE_UNIT` each); forward-only batches: the reference
    pass over all windows, three content start candidates on all windows, the held-out evaluations (every 10 steps and
    at the end) and the final training objective. Per layer: its capture and propagation (two forwards of all windows).
    """
    per_window = math.ceil(windows / batch)
    held_batches = math.ceil(held / batch)
    forwards = per_window * 5 + (steps // 10 + 1) * held_batches
    per_module = steps * (1 + ROPE_UNIT) + FORWARD_UNIT * forwards
    return layers * step * (modules * per_module + 2 * FORWARD_UNIT * per_window)


def cost_line(record: dict, layers: int, to_learn: int, threads: int, estimate: float | None,
              hint: str | None = None) -> str:
    """The log line before learning: what runs and about how long it takes (and `hint`, a shorter recipe)."""
    n, t = record["windows"]
    parts = [f"calibrating {to_learn} of {layers} decoder layers ({record['transform']}): {n} windows of {t} tokens "
             f"({n * t:,} tokens), {record['steps']} Adam steps per layer and path at learning rate {record['lr']:g}, "
             f"batch {record['batch_size']}, protection {record['protection']}; {threads} torch "
             f"thread{'s' * (threads != 1)}"]
    if estimate is not None:
        parts.append(f"estimated {estimate:.0f} s ({estimate / max(1, to_learn):.1f} s per layer, from timed steps)")
    if hint:
        parts.append(hint)
    return "; ".join(parts)
