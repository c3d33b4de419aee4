"""Generation-scored evaluation: greedy answers through ``model.generate`` and their scores.

Shared by passkey, RULER and NIAH: the chunked prefill that bounds memory at 64K+ tokens, the
greedy continuation, the loop over prompts x models (same prompts for every model; an
out-of-memory length marks that length and longer ones ``OOM`` for that model), and RULER's
scoring (recall of every expected string in the generated text).
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from retrofit.eval import loading, prompting, report
from retrofit.eval.options import RunOptions
from retrofit.eval.nll import forward_chunks
from retrofit.layers.cache import cache_keyword, output_cache
from retrofit.surgery.rope_scaling import dynamic_rope_held_at, reset_dynamic_rope

_CONTROL = re.compile(r"[\x00-\x1f]")


@torch.no_grad()
def prefill(model: Any, input_ids: torch.Tensor, chunk_size: int) -> Any:
    """Run ``input_ids`` [1, T] through the decoder ``chunk_size`` tokens at a time (no LM head) and
    return the filled cache: the model's own (a converted model's constant-memory state, a plain
    model's KV cache), so a long prompt never meets a T x T mask or whole-prompt activations."""
    cache = None
    for _, out in forward_chunks(model, input_ids, chunk_size):
        cache = output_cache(out)
        del out
    return cache


@torch.no_grad()
def generate_answer(model: Any, tokenizer: Any, ids: list[int], max_new_tokens: int, *,
                    chunk_size: int | None = None) -> str:
    """Greedy continuation of ``ids`` through ``model.generate``; returns the decoded new text.

    ``chunk_size``: a prompt longer than this is first run through the model's cache in chunks
    (all but its last token), and ``generate`` continues from that cache: the same tokens as one
    prefill, in memory bounded by the chunk instead of the prompt. A model whose RoPE follows the
    sequence length (dynamic NTK) starts from its pretraining frequencies, and its chunks are held
    at the whole prompt's frequencies, as transformers' ``generate`` prefills it in one forward."""
    reset_dynamic_rope(model)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    extra = {}
    if chunk_size and input_ids.shape[1] > chunk_size:
        with dynamic_rope_held_at(model, input_ids.shape[1]):
            extra[cache_keyword(model.forward)] = prefill(model, input_ids[:, :-1], chunk_size)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        **extra,
    )
    return tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is an out-of-memory error (CUDA or host)."""
    msg = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in msg or "not enough memory" in msg


def postprocess(text: str) -> str:
    """RULER's answer clean-up: strip, control characters to newlines, strip again."""
    return _CONTROL.sub("\n", text.strip()).strip()


def recall(prediction: str, expected: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one answer: the fraction of ``expected`` strings found
    (case-insensitive) in the post-processed prediction, in [0, 1]."""
    pred = postprocess(prediction).lower()
    return sum(1.0 for r in expected if r.lower() in pred) / len(expected) if expected else 0.0


def check_prefill_chunk(prefill_chunk: int | None) -> None:
    """A prefill chunk is None or 0 (one prefill) or a positive number of tokens; else one DataError."""
    if prefill_chunk is not None and prefill_chunk < 0:
        from retrofit.errors import DataError

        raise DataError(f"prefill_chunk must be a positive number of tokens (0 = one prefill), got {prefill_chunk}")


@dataclass(frozen=True)
class Setup:
    """What a generation-scored evaluator's prompts are built from.

    roles: ``{role: (model, tokenizer, label)}`` (:func:`retrofit.eval.variants.resolve_roles`).
    tokenizer: the model's, which builds the prompts every role reads. use_bos: whether a prompt
    begins with BOS. chat: whether prompts are wrapped in the chat template. frame: the prompt's
    wrapping (:func:`retrofit.eval.prompting.build_frame`).
    """

    roles: dict[str, tuple[Any, Any, str]]
    tokenizer: Any
    use_bos: bool
    chat: bool
    frame: prompting.Frame


def setup(model: Any, *, options: RunOptions, zero_shot: list[str] | tuple[str, ...], bos: str,
          chat_template: str, system: str | None = None) -> Setup:
    """Load the models (:meth:`RunOptions.roles`) and frame the prompts with the model's tokenizer:
    BOS by the ``bos`` policy (auto | always | never), the chat template by ``chat_template``
    (auto | on | off), and ``system`` as the chat's system turn."""
    roles = options.roles(model, zero_shot)
    m, tok, _ = roles["model"]
    use_bos = loading.needs_bos(m, tok, bos)
    chat = prompting.use_chat_template(tok, chat_template)
    frame = prompting.build_frame(tok, chat=chat, bos_id=tok.bos_token_id if use_bos else None, system=system)
    return Setup(roles=roles, tokenizer=tok, use_bos=use_bos, chat=chat, frame=frame)


def run_prompts(
    roles: dict[str, tuple[Any, Any, str]],
    prompts: list[dict],
    *,
    score: Callable[[dict, str], float],
    max_new_tokens: Callable[[dict, Any], int],
    prefill_chunk: int | None,
    desc: str,
    progress: bool = True,
    keep: Sequence[str] = (),
) -> tuple[dict[str, list[dict]], dict[str, dict[str, float]], dict[str, str | None]]:
    """Answer every prompt with every model, greedily, and score the answers.

    roles: :func:`retrofit.eval.variants.resolve_roles`' ``{role: (model, tokenizer, label)}``.
    prompts: dicts with ``ids`` (the prompt's token ids), ``length`` and the fields named in
    ``keep`` (copied into each record). score(prompt, text) -> [0, 1]; max_new_tokens(prompt,
    tokenizer) -> the generation bound. Once a length runs out of memory, that length and longer
    ones are recorded as ``OOM`` (score None) for that model. A zero-shot variant that computes
    exactly what its base does on a prompt and its answer (:func:`retrofit.eval.variants.copied_roles`)
    takes the base's record, marked ``"same_as"``, instead of running.
    Returns ``(records per role, seconds per length per role, attention implementation per role)``.
    """
    from tqdm.auto import tqdm

    from retrofit.eval import variants

    records: dict[str, list[dict]] = {}
    seconds: dict[str, dict[str, float]] = {}
    attention: dict[str, str | None] = {}
    copied = variants.copied_roles(roles)
    bar = tqdm(total=len(prompts) * len(roles), desc=desc, unit="prompt", disable=not progress)
    for role in variants.scoring_order(roles):
        mdl, mtok, label = roles[role]
        source, same_up_to = copied.get(role, (None, 0))
        out: list[dict] = []
        oom_from: int | None = None
        secs: dict[str, float] = {}
        with loading.scoring_attention(mdl) as attention[role]:
            for i, p in enumerate(prompts):
                L = p["length"]
                bar.set_postfix_str(f"{label} {report.fmt_length(L)}")
                rec = {k: p[k] for k in ("length", *keep) if k in p}
                max_new = max_new_tokens(p, mtok)
                same = records[source][i] if source is not None and len(p["ids"]) + max_new <= same_up_to else None
                if same is not None and same.get("error") is None:
                    rec.update(output=same["output"], score=same["score"], same_as=source)
                elif oom_from is not None and L >= oom_from:
                    rec.update(output=None, score=None, error="OOM")
                else:
                    t0 = time.perf_counter()
                    try:
                        text = generate_answer(mdl, mtok, p["ids"], max_new, chunk_size=prefill_chunk)
                    except Exception as exc:
                        if not is_oom(exc):
                            raise
                        oom_from = L
                        rec.update(output=None, score=None, error="OOM")
                    else:
                        secs[str(L)] = secs.get(str(L), 0.0) + time.perf_counter() - t0
                        rec.update(output=text[:300], score=score(p, text))
                out.append(rec)
                bar.update(1)
        records[role], seconds[role] = out, secs
    bar.close()
    return {role: records[role] for role in roles}, {role: seconds[role] for role in roles}, attention


def copied_note(records: dict[str, list[dict]]) -> str:
    """The sentence a generation-scored table adds when some of its cells are a base's, copied; else ''."""
    if not any(r.get("same_as") for recs in records.values() for r in recs):
        return ""
    return (" '= base': a zero-shot variant that computes exactly what the base does on those prompts (a RoPE cap "
            "N on prompts and answers within N + 1 tokens, dynamic NTK within the pretraining context) has the "
            "base's answers, not run again.")


def mean_or_none(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are not None (None if none are)."""
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None
