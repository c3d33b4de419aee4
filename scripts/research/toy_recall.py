"""Can a conversion learn, with its new weights only, to recall past its window? A toy answer.

The SmolLM2 runs leave two explanations for "no retrieval beyond the window": the method (its state,
how it reads the pretrained q/k) or the budget (a few hundred thousand CPU tokens of one task where
published conversions use tens of millions to billions). This script separates them at a scale
where the budget is not the limit:

1. a small LLaMA (transformers' ``LlamaForCausalLM``, GQA, RoPE) is pretrained from scratch with
   full attention on multi-query associative recall (MQAR, Zoology): ``pairs`` key-value pairs,
   then filler, then the keys again in a new order, each to be answered with its value; the filler
   length varies so the base retrieves at every distance;
2. it is converted in every layer (``retrofit.convert``), and its closed twin (the ``window``-token
   window alone) is scored with every query farther back than the window;
3. only the conversion's new weights are trained on the same task (queries beyond the window),
   and the answers' accuracy is reported every ``--eval-every`` steps, for each method asked.

    python scripts/research/toy_recall.py --methods delta macchiato --out runs/toy_recall.json
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import retrofit
from retrofit.fs.atomic import atomic_file, write_json_atomic


def mqar_batch(batch: int, *, pairs: int, queries: int, keys: int, values: int, filler_vocab: int,
               filler: tuple[int, int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (B, T), targets (B, T))``: BOS, pairs ``k v``, filler, then ``queries`` of the pairs'
    keys (drawn without repeats, in a random order), each followed by its value.

    With fewer queries than pairs a model cannot answer by elimination (the values not yet asked
    for): it has to match the key.

    Token ids: 0 BOS, ``1..keys`` keys, then ``values`` value ids, then ``filler_vocab`` filler ids.
    ``targets`` is -100 except at each query key, where it holds that key's value (the next token).
    Every sequence of a batch has the same filler length, drawn from ``filler`` (inclusive)."""
    lo, hi = filler
    n_filler = int(torch.randint(lo, hi + 1, (1,), generator=generator))
    k = torch.stack([torch.randperm(keys, generator=generator)[:pairs] for _ in range(batch)]) + 1
    v = torch.randint(0, values, (batch, pairs), generator=generator) + 1 + keys
    fill = torch.randint(0, filler_vocab, (batch, n_filler), generator=generator) + 1 + keys + values
    order = torch.stack([torch.randperm(pairs, generator=generator)[:queries] for _ in range(batch)])
    qk, qv = k.gather(1, order), v.gather(1, order)
    bos = torch.zeros(batch, 1, dtype=torch.long)
    ids = torch.cat([bos, torch.stack([k, v], -1).flatten(1), fill, torch.stack([qk, qv], -1).flatten(1)], 1)
    targets = torch.full_like(ids, -100)
    start = 1 + 2 * pairs + n_filler
    targets[:, start:-1:2] = qv
    return ids, targets


def copy_batch(batch: int, *, segment: int, keys: int, values: int, filler_vocab: int, filler: tuple[int, int],
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (B, T), targets (B, T))``: BOS, ``segment`` distinct key tokens, filler, the same
    segment again; every token of the repeat but its first is to be predicted from the copy before
    the filler (an induction copy: match the previous token, read the one after it). The token ids
    follow :func:`mqar_batch` (values unused)."""
    lo, hi = filler
    n_filler = int(torch.randint(lo, hi + 1, (1,), generator=generator))
    seg = torch.stack([torch.randperm(keys, generator=generator)[:segment] for _ in range(batch)]) + 1
    fill = torch.randint(0, filler_vocab, (batch, n_filler), generator=generator) + 1 + keys + values
    ids = torch.cat([torch.zeros(batch, 1, dtype=torch.long), seg, fill, seg], 1)
    targets = torch.full_like(ids, -100)
    targets[:, -segment:-1] = seg[:, 1:]
    return ids, targets


def recall_loss_acc(model, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    logits = model(input_ids=ids).logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    mask = targets != -100
    acc = (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()
    return loss, acc


@torch.no_grad()
def evaluate(model, batches) -> float:
    model.eval()
    acc = sum(recall_loss_acc(model, i, t)[1] for i, t in batches) / len(batches)
    model.train()
    return acc


def train(model, params, data, *, steps: int, lr: float, eval_batches, eval_every: int, label: str) -> list:
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    curve, t0 = [], time.perf_counter()
    model.train()
    for step in range(1, steps + 1):
        loss, _ = recall_loss_acc(model, *data())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == steps:
            acc = evaluate(model, eval_batches)
            curve.append({"step": step, "loss": round(loss.item(), 4), "acc": round(acc, 4)})
            print(f"[{label}] step {step:5d}  loss {loss.item():.4f}  recall beyond the window {acc:.1%}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["delta", "macchiato"])
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--task", choices=("recall", "copy"), default="recall",
                   help="recall: key-value pairs, then keys to answer; copy: a segment of --segment distinct "
                        "tokens repeated after the filler (every repeated token but the first is scored)")
    p.add_argument("--segment", type=int, default=16)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--queries", type=int, default=None, help="keys asked for per sequence (default: --pairs)")
    p.add_argument("--keys", type=int, default=64)
    p.add_argument("--values", type=int, default=64)
    p.add_argument("--filler-vocab", type=int, default=64)
    p.add_argument("--far-filler", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"),
                   help="filler tokens between the pairs and the queries when scoring and converting")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--base-steps", type=int, default=3000)
    p.add_argument("--steps", type=int, default=1500, help="training steps of each conversion's new weights")
    p.add_argument("--base-lr", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--option", action="append", default=[], metavar="METHOD:KEY=VALUE",
                   help="a conversion option for one method, e.g. macchiato:latents=32 (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-cache", type=Path, default=None,
                   help="the pretrained base's weights: loaded from this file when it exists, else saved there")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 1 + args.keys + args.values + args.filler_vocab
    length = (1 + 2 * (args.pairs + (args.queries or args.pairs)) if args.task == "recall" else 1 + 2 * args.segment) \
        + args.far_filler[1]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4 * length, rope_theta=10000.0,
                      tie_word_embeddings=True)
    base = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(args.seed)
    args.queries = args.pairs if args.queries is None else args.queries
    vocabs = dict(keys=args.keys, values=args.values, filler_vocab=args.filler_vocab)
    if args.task == "recall":
        make = functools.partial(mqar_batch, pairs=args.pairs, queries=args.queries, **vocabs)
    else:
        make = functools.partial(copy_batch, segment=args.segment, **vocabs)
    near = lambda: make(args.batch, filler=(0, args.far_filler[1]), generator=gen)  # noqa: E731
    far = lambda: make(args.batch, filler=tuple(args.far_filler), generator=gen)  # noqa: E731
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    eval_batches = [make(128, filler=tuple(args.far_filler), generator=eval_gen) for _ in range(4)]

    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "chance": 1.0 / (args.values if args.task == "recall" else args.keys),
              "guess_among_pairs": 1.0 / args.pairs if args.task == "recall" else None}
    print(f"base: {sum(p.numel() for p in base.parameters()):,} parameters, sequences of "
          f"{length - args.far_filler[1] + args.far_filler[0]}-{length} tokens", flush=True)
    if args.base_cache is not None and args.base_cache.is_file():
        base.load_state_dict(torch.load(args.base_cache, weights_only=True))
        result["base"] = [{"step": None, "acc": round(evaluate(base, eval_batches), 4), "from": str(args.base_cache)}]
        print(f"base from {args.base_cache}: recall beyond the window {result['base'][0]['acc']:.1%}", flush=True)
    else:
        result["base"] = train(base, list(base.parameters()), near, steps=args.base_steps, lr=args.base_lr,
                               eval_batches=eval_batches, eval_every=args.eval_every, label="base, full attention")
        if args.base_cache is not None:
            with atomic_file(args.base_cache, "wb") as fh:
                torch.save(base.state_dict(), fh)
    options: dict[str, dict] = {}
    for item in args.option:
        method, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        options.setdefault(method, {})[key] = json.loads(value) if value[:1].isdigit() or value[:1] in "-[" else value
    result["methods"] = {}
    for method in args.methods:
        opts = dict(window=args.window, **options.get(method, {}))
        twin = retrofit.convert(copy.deepcopy(base), method=method, **{**opts, "init_swa_share": 1.0}) \
            if method in ("delta", "macchiato") else None
        closed = evaluate(twin, eval_batches) if twin is not None else None
        model = retrofit.convert(copy.deepcopy(base), method=method, **opts)
        params = [p for p in model.parameters() if p.requires_grad]
        print(f"{method} {opts}: {sum(p.numel() for p in params):,} new weights; closed twin "
              f"{'-' if closed is None else f'{closed:.1%}'}; untrained {evaluate(model, eval_batches):.1%}", flush=True)
        curve = train(model, params, far, steps=args.steps, lr=args.lr, eval_batches=eval_batches,
                      eval_every=args.eval_every, label=method)
        result["methods"][method] = {"options": opts, "closed_twin": closed, "curve": curve}
    if args.out:
        write_json_atomic(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
