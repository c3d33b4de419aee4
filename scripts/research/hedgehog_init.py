"""A ``--method hedgehog`` conversion whose feature maps and scales come from ``hedgehog_fit.py``.

LoLCATs' first stage fits the feature maps to the base's attention weights; ``hedgehog_fit.py``
does that on the base's own queries and keys (KL to the softmax beyond the window, and the
log-scale by least squares). This script converts the base with the same window and sinks,
copies each layer's fitted ``query`` / ``key`` maps and ``log_scale`` into the layer's
``feature_query`` / ``feature_key`` / ``memory_scale`` and saves a delta that every ``retrofit``
verb reads (``eval ppl``, ``eval passkey``, ``bench``, ``train`` from it).

    python scripts/research/hedgehog_init.py --maps runs/oracle/hedgehog-lse-4k-f128.safetensors --out runs/hedgehog/fit-4k

The window, sinks and ``memory_distance`` are the fit's own (its ``--beyond``, ``--sinks``, ``--distance``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from retrofit.surgery import convert, save_delta
from retrofit.surgery.distill import converted_modules
from retrofit.surgery.loading import load_any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--maps", type=Path, required=True, help="hedgehog_fit.py's safetensors (fitted with --beyond)")
    ap.add_argument("--window", type=int, default=None, help="default: the --beyond the maps were fitted with")
    ap.add_argument("--sinks", type=int, default=None, help="default: the --sinks the maps were fitted with")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args()

    maps = load_file(str(args.maps))
    with safe_open(str(args.maps), framework="pt") as f:
        fitted = json.loads((f.metadata() or {}).get("args", "{}"))
    window = args.window if args.window is not None else fitted.get("beyond")
    sinks = args.sinks if args.sinks is not None else fitted.get("sinks", 4)
    if not window:
        raise SystemExit(f"error: {args.maps} was not fitted beyond a window: pass --window or fit with --beyond")
    model, _ = load_any(args.model, dtype=torch.float32)
    features = maps["layers.0.query"].shape[1]
    options = {"sinks": sinks, "features": features, "memory_distance": fitted.get("distance")}
    convert(model, method="hedgehog", window=window, options=options, base_model=args.model)
    with torch.no_grad():
        for attn in converted_modules(model):
            li = int(attn.layer_idx)
            scale = maps.get(f"layers.{li}.log_scale")
            if scale is None:
                raise SystemExit(f"error: {args.maps} has no layers.{li}.log_scale: fit it with hedgehog_fit.py --beyond")
            attn.feature_query.weight.copy_(maps[f"layers.{li}.query"])
            attn.feature_key.weight.copy_(maps[f"layers.{li}.key"])
            d = attn.head_dim  # (H, d + 1): [a, b]; (H, d + 2): [a, b, g] (fitted with the key count)
            attn.memory_scale.weight.copy_(scale[:, :d])
            attn.memory_scale.bias.copy_(scale[:, d])
            if scale.shape[1] == d + 2:
                attn.memory_scale.count_weight.copy_(scale[:, d + 1])
    save_delta(model, args.out, base_model=args.model, overwrite=args.overwrite)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
