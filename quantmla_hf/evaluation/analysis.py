"""Dual-path matched-error analysis (paper section 2.2 / B.1) and per-layer quantized attention error.

`analyze(model, token_ids)`: for every MLA attention module, take the INT4 quantization error of each cached path
(content latent `c`, post-RoPE key `k_R`) on the given windows, rescale it so that the path's cache NMSE
`sum |e|^2 / sum |x|^2` is exactly `target_nmse` (0.01), perturb that path alone (the other path exact) and
measure the NMSE of the attention output after `o_proj`. The response of a path is `output NMSE / cache NMSE`.
The model-level RoPE/content ratio divides the mean RoPE response by the mean content response (aggregate
responses, not an average of per-layer ratios).

`quantized_attention_error(model, token_ids, ...)`: per-layer attention-output NMSE with both paths quantized
(no protected tokens), the number the calibration objectives aim to lower.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import asdict, dataclass, field

import torch
from transformers.utils.logging import tqdm  # honours transformers.utils.logging.disable_progress_bar()

from ..attention.state import mla_attention_modules
from ..calibration.capture import AttentionRunner, LatentHook, capture_inputs
from ..calibration.objectives import quantize_dequantize
from ..calibration.offload import materialized
from ..format import PathFormat


@dataclass
class LayerResponse:
    """Responses of one attention module: output NMSE per unit of cache NMSE, for each path alone."""

    layer_idx: int
    content_response: float
    rope_response: float

    @property
    def ratio(self) -> float:
        return self.rope_response / self.content_response if self.content_response > 0 else math.inf


@dataclass
class DualPathReport:
    """Per-layer responses and the model-level RoPE/content ratio of aggregate responses."""

    layers: list = field(default_factory=list)
    bits: int = 4
    group_size: int = 64
    target_nmse: float = 0.01

    @property
    def content_mean(self) -> float:
        return sum(r.content_response for r in self.layers) / max(len(self.layers), 1)

    @property
    def rope_mean(self) -> float:
        return sum(r.rope_response for r in self.layers) / max(len(self.layers), 1)

    @property
    def ratio(self) -> float:
        """Model-level RoPE/content ratio: mean RoPE response over mean content response."""
        return self.rope_mean / self.content_mean if self.content_mean > 0 else math.inf

    def to_dict(self) -> dict:
        return {
            "bits": self.bits, "group_size": self.group_size, "target_nmse": self.target_nmse,
            "content_mean": self.content_mean, "rope_mean": self.rope_mean, "ratio": self.ratio,
            "layers": [{**asdict(r), "ratio": r.ratio} for r in self.layers],
        }

    def to_markdown(self) -> str:
        lines = [
            f"Dual-path matched-error analysis: INT{self.bits} error directions (group {self.group_size}) rescaled "
            f"to cache NMSE {self.target_nmse:g}; response = output NMSE after o_proj / cache NMSE.",
            "",
            "| layer | content response | RoPE response | RoPE/content |",
            "| ---: | ---: | ---: | ---: |",
        ]
        lines += [f"| {r.layer_idx} | {r.content_response:.4g} | {r.rope_response:.4g} | {r.ratio:.4g} |"
                  for r in self.layers]
        lines.append(f"| **model** (aggregate) | {self.content_mean:.4g} | {self.rope_mean:.4g} | **{self.ratio:.4g}** |")
        return "\n".join(lines) + "\n"

    def save_plot(self, path: str) -> str:
        """Write a PNG of the per-layer responses: with matplotlib a labelled bar chart (log scale); without it a
        plain bar image (content blue, RoPE orange, heights linear in the response, no text). Returns `path`."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            _png_bars(path, [r.content_response for r in self.layers], [r.rope_response for r in self.layers])
            return path
        x = list(range(len(self.layers)))
        fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(x) + 2), 4))
        ax.bar([i - 0.2 for i in x], [r.content_response for r in self.layers], 0.4, label="content", color="#1f77b4")
        ax.bar([i + 0.2 for i in x], [r.rope_response for r in self.layers], 0.4, label="RoPE", color="#ff7f0e")
        ax.set_yscale("log")
        ax.set_xticks(x, [str(r.layer_idx) for r in self.layers])
        ax.set_xlabel("attention layer")
        ax.set_ylabel("output NMSE / cache NMSE")
        ax.set_title(f"matched cache NMSE {self.target_nmse:g}: RoPE/content = {self.ratio:.2f}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _png_bars(path: str, content: list, rope: list, height: int = 200) -> None:
    n = len(content)
    width = max(64, 12 * n + 8)
    top = max(content + rope + [1e-30])
    white, blue, orange = (255, 255, 255), (31, 119, 180), (255, 127, 14)
    rows = []
    for y in range(height):
        level = (height - 1 - y) / (height - 1)
        row = bytearray(b"\x00")
        for xpix in range(width):
            i, off = divmod(xpix - 4, 12)
            color = white
            if 0 <= i < n and xpix >= 4:
                if off < 5 and content[i] / top > level:
                    color = blue
                elif 5 <= off < 10 and rope[i] / top > level:
                    color = orange
            row += bytes(color)
        rows.append(bytes(row))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(b"".join(rows), 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


def _layer_streams(runner: AttentionRunner):
    """Clean outputs `[N, T, hidden]`, latents `[N, 1, T, d_c]` and keys `[N, 1, T, d_R]` of one module."""
    outs, lat, rot = [], [], []
    for _, h in runner.inputs.batches():
        hook = LatentHook()
        outs.append(runner(h, None, hook))
        lat.append(hook.latent)
        rot.append(hook.k_rot)
    return torch.cat(outs), torch.cat(lat), torch.cat(rot)


def _output_nmse(runner: AttentionRunner, clean: torch.Tensor, fn) -> float:
    num = den = 0.0
    for rows, h in runner.inputs.batches():
        out = runner(h, None, LatentHook(lambda c, r, rows=rows: fn(c, r, rows)))
        ref = clean[rows.to(clean.device)]
        num += float((out - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return num / max(den, 1e-30)


@torch.no_grad()
def analyze(model: torch.nn.Module, token_ids: torch.Tensor, bits: int = 4, group_size: int = 64,
            target_nmse: float = 0.01, batch_size: int = 8, progress: bool = True) -> DualPathReport:
    """Dual-path matched-error study of `model` on `token_ids: [N, T]` (see the module docstring)."""
    if token_ids.dim() != 2:
        raise ValueError(f"token_ids must be [N, T], got {tuple(token_ids.shape)}")
    if not target_nmse > 0:
        raise ValueError(f"target_nmse must be positive, got {target_nmse}")
    report = DualPathReport(bits=bits, group_size=group_size, target_nmse=target_nmse)
    was_training = model.training
    model.eval()
    for m in tqdm(mla_attention_modules(model), desc="dual-path analysis", disable=not progress):
        inputs = capture_inputs(model, m, token_ids, batch_size)
        with materialized(m):  # offloaded weights are real while the layer is replayed
            runner = AttentionRunner(m, inputs)
            clean, c, r = _layer_streams(runner)
            errors = []
            for x in (c, r):
                e = quantize_dequantize(x, PathFormat(x.shape[-1], bits, group_size)) - x
                energy = float(e.pow(2).sum())
                if energy == 0:
                    raise ValueError(f"layer {m.layer_idx}: INT{bits} quantization of a path is exact; no error direction")
                errors.append(e * math.sqrt(target_nmse * float(x.pow(2).sum()) / energy))
            e_c, e_r = errors
            content = _output_nmse(runner, clean, lambda cc, rr, rows: (cc + e_c[rows.to(e_c.device)], rr))
            rope = _output_nmse(runner, clean, lambda cc, rr, rows: (cc, rr + e_r[rows.to(e_r.device)]))
            report.layers.append(LayerResponse(int(m.layer_idx), content / target_nmse, rope / target_nmse))
    model.train(was_training)
    return report


@torch.no_grad()
def quantized_attention_error(model: torch.nn.Module, token_ids: torch.Tensor, content_bits: int, rope_bits: int,
                              group_size: int = 64, rope_rotation: torch.Tensor | None = None,
                              batch_size: int = 8) -> list[float]:
    """Per-layer attention-output NMSE after `o_proj` with both cached paths quantized (every token).

    Args:
        rope_rotation: optional `[d_R, d_R]` online rotation of the RoPE key (the "hadamard" baseline's cache).
    """
    out = []
    for m in mla_attention_modules(model):
        inputs = capture_inputs(model, m, token_ids, batch_size)
        with materialized(m):  # offloaded weights are real while the layer is replayed
            runner = AttentionRunner(m, inputs)
            clean, c, r = _layer_streams(runner)
            fc, fr = PathFormat(c.shape[-1], content_bits, group_size), PathFormat(r.shape[-1], rope_bits, group_size)

            def quantized(cc, rr, rows):
                if rope_rotation is None:
                    rr_hat = quantize_dequantize(rr, fr)
                else:
                    rot = rope_rotation.to(rr)
                    rr_hat = quantize_dequantize(rr @ rot.T, fr) @ rot
                return quantize_dequantize(cc, fc), rr_hat

            out.append(_output_nmse(runner, clean, quantized))
    return out
