"""The fla delta-rule kernel's forward against the token-by-token reference, and its forward time
beside the torch chunked form, on one CUDA GPU (the check behind docs/gpu.md's numbers; it needs
no backward, which fla refuses on Hopper with Triton 3.4-3.7.0).

    RETROFIT_FLA_AUTOTUNE=quick python scripts/gpu/delta_fla_check.py

Accuracy: fp32 and bf16 inputs, T 63 and 1000, left padding, the final memory; relative error of
the output and of the memory against the reference in fp32 on the same inputs. Speed: the forward
at the SmolLM2 GPU recipe's shape (B 4, 9 heads, 8192 tokens, d 64, bf16), mean of 5 after one warm-up.
"""
from __future__ import annotations

import time

import torch

import retrofit.ops as ops
from retrofit.ops.delta_rule import delta_rule_reference


def _unit(*shape: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(*shape, device="cuda"), dim=-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def accuracy() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for T in (63, 1000):
            q, k = _unit(2, 3, T, 64).to(dtype), _unit(2, 3, T, 64).to(dtype)
            v = torch.randn(2, 3, T, 64, device="cuda").to(dtype)
            beta, g = torch.rand(2, 3, T, device="cuda"), -0.1 * torch.rand(2, 3, T, device="cuda")
            mask = torch.ones(2, T, dtype=torch.bool, device="cuda")
            mask[1, :5] = False
            out, st = ops.delta_rule_chunked(q, k, v, beta, g, scale=0.125, key_padding_mask=mask,
                                             output_final_state=True, backend="fla")
            ref, ref_st = delta_rule_reference(q.float(), k.float(), v.float(), beta, g, scale=0.125,
                                               key_padding_mask=mask, output_final_state=True)
            print(f"{dtype} T {T}: output rel err {_rel(out, ref):.2e}, memory rel err "
                  f"{_rel(st.memory, ref_st.memory):.2e}", flush=True)


@torch.no_grad()
def speed() -> None:
    B, H, T, d = 4, 9, 8192, 64
    q, k = _unit(B, H, T, d).bfloat16(), _unit(B, H, T, d).bfloat16()
    v = torch.randn(B, H, T, d, device="cuda").bfloat16()
    beta, g = torch.rand(B, H, T, device="cuda"), torch.full((B, H, T), -1e-3, device="cuda")
    for backend, chunk in (("fla", 64), ("torch", 64), ("torch", 128)):
        ops.delta_rule_chunked(q, k, v, beta, g, chunk_size=chunk, backend=backend)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            ops.delta_rule_chunked(q, k, v, beta, g, chunk_size=chunk, backend=backend)
        torch.cuda.synchronize()
        print(f"{backend} C {chunk}: forward {(time.perf_counter() - t) / 5 * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    accuracy()
    speed()
