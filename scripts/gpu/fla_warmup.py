"""Time the first (autotuning) and later calls of the fla kernels behind causal Latte and exp-linear.

fla's Triton kernels autotune on their first call for each key (head dims, dtype): minutes of
compiling on a fresh machine, then cached in Triton's cache folder (TRITON_CACHE_DIR, default
~/.triton/cache) with the chosen configs. This script pays that cost once, per shape, and says how
long each call took, with a stack dump every ``--dump`` seconds if a call does not return.

    python scripts/gpu/fla_warmup.py --shape 8,8,2048,16,256 --shape 8,32,2048,16,128 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch


def _timed(label: str, fn) -> None:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    print(f"{label}: {time.perf_counter() - t0:8.2f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", default=[], help="B,H,T,L,D (latent states per head L, value dim D)")
    p.add_argument("--dtype", action="append", default=[], choices=["bfloat16", "float16", "float32"])
    p.add_argument("--ops", default="latte,exp_linear")
    p.add_argument("--dump", type=float, default=60.0, help="dump every thread's stack after this many seconds")
    a = p.parse_args(argv)
    import retrofit.ops as ops

    faulthandler.dump_traceback_later(a.dump, repeat=True, file=sys.stderr)
    for shape in a.shape or ["2,4,1024,16,64"]:
        B, H, T, L, D = (int(x) for x in shape.split(","))
        for name in a.dtype or ["bfloat16"]:
            dtype = getattr(torch, name)
            q = torch.softmax(torch.randn(B, H, T, L, device="cuda"), -1).to(dtype).requires_grad_()
            k = torch.randn(B, H, T, L, device="cuda").to(dtype).requires_grad_()
            v = torch.randn(B, H, T, D, device="cuda").to(dtype).requires_grad_()
            for op in a.ops.split(","):
                if op == "latte":
                    run = lambda: ops.causal_latte_chunked(q, k, v, backend="fla")[0]  # noqa: E731
                else:
                    qe = torch.randn(B, H, T, D, device="cuda").to(dtype).requires_grad_()
                    ke = torch.randn(B, H, T, D, device="cuda").to(dtype).requires_grad_()
                    run = lambda: ops.exp_linear_attention(qe, ke, v, backend="fla")[0]  # noqa: E731
                for i in range(3):
                    _timed(f"{op} {shape} {name} fwd #{i}", run)
                    _timed(f"{op} {shape} {name} fwd+bwd #{i}", lambda: run().float().sum().backward())
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
