"""Time the CPU sliding-window forms against each other without autograd: the banded form, and the
fused kernel over all keys (``_fused_dense``) or block by block (``_fused_blocked``), for given head
shapes, windows and call lengths. The measurement behind ``FUSED_MAX_HEAD_DIM`` in
``retrofit/ops/sliding_window.py``.

    python scripts/research/time_window_forms.py --heads 9 3 --head-dim 64 --windows 512 1024 2048
    python scripts/research/time_window_forms.py --heads 4 1 --head-dim 256 --windows 512 1024 2048

Each row: one call of ``--queries`` queries with ``w - 1`` cached keys before them (a chunk in the
middle of a long sequence), and with none (the first chunk); median of ``--repeats`` timed runs
after one warm-up, fp32, milliseconds.
"""
from __future__ import annotations

import argparse
import time

import torch

from retrofit.ops import sliding_window as swa


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs=2, default=(9, 3), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--windows", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--queries", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d, T = *args.heads, args.head_dim, args.queries
    print("| window | cached keys | banded ms | fused ms (form) | fused / banded |")
    print("|---:|---:|---:|---:|---:|")
    for w in args.windows:
        for past in (w - 1, 0):
            q = torch.randn(1, hq, T, d)
            k, v = torch.randn(1, hkv, T + past, d), torch.randn(1, hkv, T + past, d)
            with torch.no_grad():
                banded = _median_ms(lambda: swa._banded_blocked(q, k, v, w, d**-0.5, None, None, past, with_lse=True),
                                    args.repeats)
                if past + T <= 2 * w:
                    form, fused = "all keys", _median_ms(lambda: swa._fused_dense(q, k, v, w, None, None, past),
                                                         args.repeats)
                else:
                    form, fused = "blocks", _median_ms(lambda: swa._fused_blocked(q, k, v, w, d**-0.5, None, past),
                                                       args.repeats)
            print(f"| {w} | {past} | {banded:.0f} | {fused:.0f} ({form}) | {fused / banded:.2f} |", flush=True)


if __name__ == "__main__":
    main()
