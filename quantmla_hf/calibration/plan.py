"""What a calibration will run and what it will cost, said before it starts.

The recipe (windows, their length, Adam steps) is chosen by where the attention modules compute:

- GPU: the options as given, i.e. by default 64 windows of 512 tokens and 100 steps per layer and path (45-59 s
  for the converted SmolLM2-135M on an H200, docs/CALIBRATION.md).
- CPU: `CPU_RECIPE` for every recipe option the user did not give (`QuantMLAConfig.explicit_options`): 32 windows of
  256 tokens and 25 steps, 1/4 of the tokens per step and 1/4 of the steps. The default recipe would take 2-3 minutes
  per layer of the 14.8 M embedded model on a 2-core CPU and 11-15 minutes per layer of the converted SmolLM2; on
  held-out WikiText-2 the CPU recipe's KL against the default recipe's is measured in docs/CALIBRATION.md ("The CPU
  recipe"), which is what allows it.

`cost_line` is the log line before learning starts: tokens, windows, steps, layers, threads and an estimate from one
timed forward and backward of the first attention module on one batch (`timed_step`) and the work count of the recipe
(`estimate_seconds`).
"""

from __future__ import annotations

import math
import time

import torch

from .capture import LatentHook
from .protection import dual_history

CPU_RECIPE = {"calibration_samples": 32, "calibration_seq_len": 256, "calibration_steps": 25}
GPU_RECIPE_NOTE = "the library's recipe"
# Cost of a forward-only batch, and of a RoPE step, in content steps (forward + backward of one batch), as measured on
# the CPU (docs/CALIBRATION.md): the estimate is a count of these units times one timed step.
FORWARD_UNIT = 0.4
ROPE_UNIT = 0.1


def recipe_for(config, device: torch.device, token_ids_given: bool) -> tuple[dict, str]:
    """`(changes, why)`: the recipe options to change for calibrating on `device` (empty on a GPU or when the user
    gave them all), and a sentence naming the recipe and why. With token ids given (`token_ids_given`) the windows are
    the user's and only the step count can change."""
    options = ("calibration_steps",) if token_ids_given else tuple(CPU_RECIPE)
    given = set(getattr(config, "explicit_options", ()))
    if device.type != "cpu":
        return {}, f"recipe: {GPU_RECIPE_NOTE} ({device.type})"
    changes = {k: CPU_RECIPE[k] for k in options if k not in given and getattr(config, k) != CPU_RECIPE[k]}
    if not changes:
        return {}, "recipe: as given (CPU)"
    kept = ", ".join(f"{k}={getattr(config, k)}" for k in options if k in given)
    return changes, ("recipe: the CPU recipe (" + ", ".join(f"{k}={v}" for k, v in changes.items()) + ")"
                     + (f", with {kept} as given" if kept else "")
                     + ": the model computes on the CPU, where the GPU recipe takes minutes per layer; on held-out "
                     "text it tied the GPU recipe (docs/CALIBRATION.md). Pass these options to choose them")


def timed_step(runner, mask: torch.Tensor | None) -> float:
    """Seconds of one forward and backward of the attention module (`AttentionRunner`) on its first batch, in the
    dtype learning uses, gradients through `kv_b_proj` (as a content step's flow through the transformed weights);
    with `mask` (`protection.dual_history_mask`) over the doubled history the protected content objective reads."""
    rows = torch.arange(min(runner.inputs.batch_size, runner.inputs.hidden.shape[0]))
    h = runner.inputs.select(rows)
    weight = runner.params["kv_b_proj.weight"].detach().clone().requires_grad_(True)
    start = time.perf_counter()
    with torch.enable_grad():
        # With protection modelled the content objective attends over a doubled history under `mask`.
        hook = None if mask is None else LatentHook(lambda latent, k_rot: dual_history(latent, k_rot, latent, k_rot))
        out = runner(h, {"kv_b_proj.weight": weight}, hook, attention_mask=mask)
        out.float().pow(2).mean().backward()
    if weight.grad is not None and weight.grad.is_cuda:
        torch.cuda.synchronize(weight.device)
    return time.perf_counter() - start


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


def cost_line(record: dict, layers: int, to_learn: int, threads: int, estimate: float | None) -> str:
    """The log line before learning: what runs and about how long it takes."""
    n, t = record["windows"]
    parts = [f"calibrating {to_learn} of {layers} decoder layers ({record['transform']}): {n} windows of {t} tokens "
             f"({n * t:,} tokens), {record['steps']} Adam steps per layer and path, batch {record['batch_size']}, "
             f"protection {record['protection']}; {record['recipe']}; {threads} torch thread{'s' * (threads != 1)}"]
    if estimate is not None:
        parts.append(f"estimated {estimate:.0f} s ({estimate / max(1, to_learn):.1f} s per layer, from one timed step)")
    return "; ".join(parts)
