"""Which converted layers cost retrieval: passkey and perplexity of a model with only some layers
converted (untrained), as in BENCHMARKS.md, "Which layers carry retrieval" (measured 2026-11-24).

The base model is converted in memory with the demo's Macchiato options (w = 2048, 4 sinks,
L = 128) on ``--layers`` only (``none``: the base itself), then scored with the same functions
``retrofit eval passkey`` / ``retrofit eval ppl`` use. Results go to ``--out`` as their usual
results.json / table.md files.

    python scripts/research/layer_subsets.py --layers 17 --passkey-lengths 4096 8192 --depths 0 0.5 1
    python scripts/research/layer_subsets.py --layers 5,11 --passkey-lengths 4096 --depths 0
    python scripts/research/layer_subsets.py --layers 17 --ppl-lengths 4096 16384 32768 65536 \\
        --ppl-dataset <folder holding only jack-sheppard.txt>
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from retrofit.eval import run_passkey, run_perplexity
from retrofit.precision import auto_dtype_name
from retrofit.surgery import ConversionSpec, convert, load_any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--layers", required=True, help="comma-separated layer indices to convert, or 'none'")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--latents", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="auto (bf16 where native), float32 or bfloat16")
    ap.add_argument("--passkey-lengths", type=int, nargs="*", default=[])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--ppl-lengths", type=int, nargs="*", default=[])
    ap.add_argument("--ppl-dataset", default="pg-books-heldout")
    ap.add_argument("--out", type=Path, default=Path("runs/layer_subsets"))
    args = ap.parse_args()

    dtype = auto_dtype_name("cpu") if args.dtype == "auto" else args.dtype
    model, tok = load_any(args.model, dtype=dtype)
    tag = "base" if args.layers == "none" else "layers-" + args.layers.replace(",", "-")
    if args.layers != "none":
        layers = [int(x) for x in args.layers.split(",")]
        convert(model, ConversionSpec.from_dict({"method": "macchiato", "layers": layers, "window": args.window,
                                                 "latents": args.latents, "sinks": args.sinks}))
    if args.passkey_lengths:
        t0 = time.perf_counter()
        res = run_passkey(model, tokenizer=tok, lengths=args.passkey_lengths, depths=args.depths,
                          trials=args.trials, out=args.out / tag / "passkey", progress=False)
        print(f"{tag} ({dtype}) passkey {res['results']['model']['accuracy']} [{time.perf_counter() - t0:.0f} s]")
    if args.ppl_lengths:
        t0 = time.perf_counter()
        res = run_perplexity(model, tokenizer=tok, datasets=[args.ppl_dataset], lengths=args.ppl_lengths,
                             max_windows=1, chunk_size=4096, out=args.out / tag / "ppl", progress=False)
        for name, cells in res["results"].items():
            ppl = {L: (None if c["model"]["ppl"] is None else round(c["model"]["ppl"], 3)) for L, c in cells.items()}
            print(f"{tag} ({dtype}) perplexity {name} {ppl} [{time.perf_counter() - t0:.0f} s]")


if __name__ == "__main__":
    main()
