"""The host's statements of the Gluon decode kernels' index arithmetic (`kernels/mla_decode_gluon_common.py`), for
the tests that check the kernels' layouts and reads on the CPU: which channels a thread's unit holds, which
program of the flat grid is which, which pages a paged launch reads."""

import torch

from quantmla_hf.format import CacheFormat
from quantmla_hf.kernels.mla_decode_gluon_common import BLOCK_T, min_split_tiles


def unit_base(u: int, q, n_groups: int):
    """First channel of the 16 that thread `q` (of a quad) owns in unit u: content units `0 .. n_groups - 1`
    (`64 * (q + 4 * (u // 4)) + 16 * (u % 4)`, channels of the content latent), RoPE unit `n_groups` (`16 * q`)."""
    if u == n_groups:
        return 16 * q
    return 64 * (q + 4 * (u // 4)) + 16 * (u % 4)


def score_channel(u: int, bits: int, n_groups: int) -> torch.Tensor:
    """`[64]` int64: the channel (of the content latent for u < n_groups, of the RoPE key for u = n_groups) held by
    column c of unit u's score A operand (row-major `m64n16k16` A fragments: column `16 kc + 8 h + 2 q + e` of thread
    q holds element `E w + k + (E / 2) e` of its words, `(E / 2) w + k = 2 kc + h`); the queries are staged in it."""
    c = torch.arange(64)
    kc, h, q, e = c // 16, (c // 8) % 2, (c // 2) % 4, c % 2
    n = 16 // bits
    p = 2 * kc + h
    off = (p // n) * (2 * n) + p % n + n * e
    return unit_base(u, q, n_groups) + off


def value_channel(u: int, bits: int, n_groups: int) -> torch.Tensor:
    """`[64]` int64: the channel held by column c of unit u's stored key tile (content units: row c of `kbuf[u]`'s
    transpose, the value output's row c, in the register kernels): column
    `16 q + 8 (k % 2) + K w + 2 (k // 2) + e` of the stored tile holds element `E w + k + K e` of quad slot q's 16
    channels (`E = 32 / bits`, `K = E / 2`), so each stored 32-bit pair is one asm register and rows c and c + 8
    are adjacent channels."""
    c = torch.arange(64)
    i, h, n = c % 8, (c // 8) % 2, 16 // bits
    return unit_base(u, c // 16, n_groups) + (i // n) * (2 * n) + ((i % n) // 2) * 2 + n * (i % 2) + h


def program_coords(pid: int, NS: int, nd: int, n_hb: int, n_programs: int) -> tuple[int, int, int]:
    """`(split, head block, batch row)` of program `pid` of a flat grid of `n_programs`: the host's statement of
    `_program_coords`."""
    n_long = n_programs // (NS + nd) * NS
    if pid < n_long:
        s, r = pid % NS, pid // NS
    else:
        s, r = NS + (pid - n_long) % nd, (pid - n_long) // nd
    return s, r % n_hb, r // n_hb


def paged_reads(length: int, split: int, num_splits: int, split_target: int, fmt: CacheFormat) -> tuple[list, list]:
    """The host's statement of the paged launch's reads for one request of `length` positions (`_split_range` with
    no left padding, then `_tile_page` for tiles 0 and 1 and, in every tile the loop attends, for the tile two ahead):
    `(page_indices, tiles)`, the page-table columns read and the positions `[lo, hi)` each attended tile holds."""
    BT = BLOCK_T
    per = max(-(-(-(-max(length - fmt.recent_tokens, 0) // split_target)) // BT) * BT, min_split_tiles(fmt) * BT)
    base = split * per
    lo = max(base, fmt.sink_tokens)
    hi = lo if split >= num_splits else min(base + per, length - fmt.recent_tokens)
    n_tiles = (hi - base + BT - 1) // BT if hi > lo else 0
    last = max(hi - base - 1, 0)
    first = base // BT if n_tiles > 0 else 0
    pages = [first + max(min(t0, last // BT * BT), 0) // BT
             for t0 in [0, BT] + [it * BT + 2 * BT for it in range(n_tiles)]]
    tiles = [(max(base + it * BT, lo), min(base + it * BT + BT, hi)) for it in range(n_tiles)]
    return pages, tiles


def run_channel(u: int, bits: int, n_groups: int) -> torch.Tensor:
    """`[4, 16]` int64: the channels thread q of a quad writes as 16 contiguous values (`[q, i]`) of unit u's output
    row in the split kernel (`_store_unit`): its accumulator columns `2 q + e + 8 j` put in the order `(j // N, e, j %
    N)`, `N = 16 / bits`, the channel `unit_base(u, q) + (j // N) 2N + j % N + N e` of the score order."""
    n = 16 // bits
    j = torch.arange(8).view(8 // n, n)  # [j // N, j % N]
    cols = []
    for q in range(4):
        col = 2 * q + torch.arange(2).view(1, 2, 1) + 8 * j.view(8 // n, 1, n)  # [j // N, e, j % N]
        cols.append(col.reshape(16))
    return score_channel(u, bits, n_groups)[torch.stack(cols)]
