"""Teacher-forced recall of facts placed beyond the window: a graded retrieval probe.

Passkey accuracy is exact greedy generation of a whole key, 5 trials a cell: it reads 0 until a
model nearly retrieves. This probe measures the step before that. Held-out text is cut into
``--length``-token sequences; each gets ``--facts`` recall facts (``retrofit.data.recall``: "Note:
the locker of Mr. Hale is number 48213." early, its question and answer at least
``--min-distance`` tokens later, so beyond a window of that size). With the answer's tokens given
(teacher forcing), it reports over every value token of every answer

* ``acc``: top-1 accuracy of the next-token prediction,
* ``first``: the same for the value's first token only. SmolLM2's tokenizer writes " 48213" as
  " ", "4", "8", ...: for a number that first token is the space, which says only that a number
  follows, not which one,
* ``lead``: the same for the value's first token that is not whitespace (a number's first digit,
  a word's token): the one that needs the fact (later digits may follow from it),
* ``nll``: the mean negative log-likelihood in nats,

and ``text_nll``, the mean NLL of every other token of the same sequences (what training for
retrieval must not cost). With ``--passkey N`` it also scores N passkey prompts of ``--length``
tokens, the needle at depth 0 (beyond the window), teacher-forced the same way: ``pk_acc`` /
``pk_first`` / ``pk_lead`` / ``pk_nll`` over the key's tokens after ``The pass key is`` (plain text, the
evaluator's prompt and haystack).

for the model as loaded and, for a Macchiato conversion, with its latent path closed (its window
and sinks alone), on the same sequences.

    python scripts/research/recall_probe.py smollm2-135m runs/gpu-kl/smollm2-delta \
        --text retrofit/data/pg-books/jack-sheppard.txt --sequences 8 --length 2048 --out runs/recall_probe.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from retrofit.data.packing import make_tokenize
from retrofit.data.recall import STYLES, RecallConfig, RecallInserter
from retrofit.data.text import read_text
from retrofit.eval.loading import load_model
from retrofit.fs.atomic import write_json_atomic
from retrofit.surgery.distill import converted_modules


def probe_sequences(tokenizer, text: str, *, sequences: int, length: int, facts: int, min_distance: int,
                    seed: int, style: str = "facts") -> list[tuple[np.ndarray, list]]:
    """``[(ids (length,), placed facts)]``: consecutive blocks of ``text`` with recall facts written in."""
    ids = np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64)
    inserter = RecallInserter(RecallConfig(share=1.0, facts=facts, min_distance=min_distance, seed=seed, style=style),
                              make_tokenize(tokenizer, special_tokens=False))
    out = []
    for i in range(sequences):
        block = ids[i * length:(i + 1) * length]
        if len(block) < length:
            break
        plan = inserter.plan(length, i)
        if plan:
            out.append((inserter(block, i), plan))
    return out


def lead_index(tokenizer, value_ids) -> int:
    """Index of the first of ``value_ids`` whose text is not whitespace."""
    return next((j for j, t in enumerate(value_ids) if tokenizer.decode([t]).strip()), 0)


class Tally:
    """Teacher-forced scores of value tokens: top-1 over all, over each value's first token and over
    its lead token, and the mean NLL."""

    def __init__(self):
        self.hits, self.firsts, self.leads, self.nlls = [], [], [], []

    def add(self, logp: torch.Tensor, start: int, value_ids, tokenizer) -> None:
        """``logp``: ``(T, V)`` log-probabilities; the value's tokens sit at ``start`` onwards."""
        lead = lead_index(tokenizer, value_ids)
        for j, tok in enumerate(value_ids):
            pos = start + j - 1  # the position that predicts this value token
            hit = int(logp[pos].argmax()) == tok
            self.hits.append(hit)
            self.nlls.append(-float(logp[pos, tok]))
            if j == 0:
                self.firsts.append(hit)
            if j == lead:
                self.leads.append(hit)

    def scores(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}acc": float(np.mean(self.hits)), f"{prefix}first": float(np.mean(self.firsts)),
                f"{prefix}lead": float(np.mean(self.leads)), f"{prefix}nll": float(np.mean(self.nlls))}


@torch.no_grad()
def score(model, tokenizer, seqs: list[tuple[np.ndarray, list]]) -> dict[str, float]:
    """``acc``, ``first``, ``lead``, ``nll`` over every answer's value tokens, teacher-forced, and
    ``text_nll`` over every other token."""
    tally, text = Tally(), []
    for ids, plan in seqs:
        x = torch.from_numpy(ids)[None]
        logp = model(input_ids=x).logits[0].float().log_softmax(-1)
        token_nll = -logp[:-1].gather(-1, x[0, 1:, None]).squeeze(-1)
        keep = torch.ones_like(token_nll, dtype=torch.bool)
        for fact in plan:
            keep[fact.answer_value - 1: fact.answer_value - 1 + len(fact.value_ids)] = False
            tally.add(logp, fact.answer_value, fact.value_ids, tokenizer)
        text.append(token_nll[keep])
    return {**tally.scores(), "text_nll": float(torch.cat(text).mean()), "values": len(tally.firsts),
            "value_tokens": len(tally.hits)}


def passkey_prompts(tokenizer, *, trials: int, length: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``[(prompt ids + the key's ids, the key's ids)]``: ``eval.passkey``'s plain prompts at depth 0
    (the evaluator's own grid, so its keys and filler), 8 tokens short of ``length`` for the key."""
    from retrofit.eval.passkey import prompt_grid
    from retrofit.eval.windows import encode

    out = []
    for p in prompt_grid(tokenizer, [length - 8], [0.0], trials=trials, seed=seed):
        key_ids = encode(tokenizer, " " + p["key"])
        out.append((p["ids"] + key_ids, key_ids))
    return out


@torch.no_grad()
def score_passkey(model, tokenizer, prompts: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """``pk_acc``, ``pk_first``, ``pk_lead``, ``pk_nll`` over the keys' tokens, teacher-forced."""
    tally = Tally()
    for ids, key_ids in prompts:
        logp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
        tally.add(logp, len(ids) - len(key_ids), key_ids, tokenizer)
    return tally.scores("pk_")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="model names or folders (a Macchiato conversion is also scored closed)")
    ap.add_argument("--text", required=True, help="held-out text file")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--facts", type=int, default=4)
    ap.add_argument("--min-distance", type=int, default=1100)
    ap.add_argument("--seed", type=int, default=1234, help="recall seed (training uses 0 by default)")
    ap.add_argument("--style", default="facts", choices=STYLES, help="facts: worded templates; repeats: a cue of the "
                    "text's own tokens and a value, written again later")
    ap.add_argument("--passkey", type=int, default=0, metavar="N", help="also score N passkey prompts (depth 0)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rows, seqs, prompts = [], None, None
    for name in args.models:
        model, tokenizer = load_model(name, dtype="float32")
        if seqs is None:
            seqs = probe_sequences(tokenizer, read_text(args.text), sequences=args.sequences, length=args.length,
                                   facts=args.facts, min_distance=args.min_distance, seed=args.seed,
                                   style=args.style)
            prompts = passkey_prompts(tokenizer, trials=args.passkey, length=args.length) if args.passkey else []

        def scores() -> dict[str, float]:
            return {**score(model, tokenizer, seqs), **(score_passkey(model, tokenizer, prompts) if prompts else {})}

        modules = converted_modules(model)
        rows.append({"model": name, "latent_path": "open" if modules else "-", **scores()})
        print(rows[-1], flush=True)
        if modules and hasattr(modules[0], "latent_path_closed"):
            for m in modules:
                m.latent_path_closed = True
            rows.append({"model": name, "latent_path": "closed", **scores()})
            print(rows[-1], flush=True)
        del model
    pk = f" {'pk acc':>6} {'pk 1st':>6} {'pk lead':>7} {'pk nll':>6}" if prompts else ""
    print(f"{'model':<40} {'latent':>7} {'acc':>6} {'first':>6} {'lead':>6} {'nll':>6} {'text nll':>8}{pk}")
    for r in rows:
        pk = f" {r['pk_acc']:>6.1%} {r['pk_first']:>6.1%} {r['pk_lead']:>7.1%} {r['pk_nll']:>6.3f}" if prompts else ""
        print(f"{r['model'][-40:]:<40} {r['latent_path']:>7} {r['acc']:>6.1%} {r['first']:>6.1%} {r['lead']:>6.1%} {r['nll']:>6.3f} "
              f"{r['text_nll']:>8.4f}{pk}")
    if args.out:
        write_json_atomic(args.out, {"text": args.text, "length": args.length, "facts": args.facts,
                                     "min_distance": args.min_distance, "seed": args.seed, "style": args.style, "passkey": args.passkey,
                                     "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
