"""`retrofit generate`: stream text from a converted checkpoint (or any model load_any accepts).

    retrofit generate out/g270-mac --prompt "The old fisherman said" --max-new-tokens 100
    retrofit generate out/g270-mac --prompt "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 1

Converted layers decode with a constant-memory cache (latent state + the last w-1 keys and
values); the cache size is printed at the end. ``--compile`` decodes through
:class:`retrofit.decoding.CompiledDecoder` (every layer Macchiato, delta or Hedgehog, LLaMA-shaped families): one
compiled graph per token, whose compilation the first token pays.
"""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("generate", help=help_text, description=help_text)
    p.add_argument("model", metavar="DIR", help="converted checkpoint folder (or model folder / hub id / .gguf / alias)")
    p.add_argument("--prompt", required=True, help="text to continue ('-' reads stdin)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens to generate at most (it stops early at an end-of-sequence token), 1 to 1048576 "
                        "(1M)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: as stored)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--compile", action="store_true",
                   help="decode through retrofit.decoding.CompiledDecoder: one compiled step per token (a model with "
                        "every layer Macchiato, delta or Hedgehog, LLaMA-shaped). The first run compiles for about a minute, later runs "
                        "reuse inductor's cache (seconds): worth it for long outputs")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import math
    import sys
    import time

    from retrofit.errors import RetrofitError

    if args.max_new_tokens < 1:
        raise RetrofitError("--max-new-tokens must be >= 1")
    from retrofit.eval.evaluators import check_new_tokens

    check_new_tokens("--max-new-tokens", args.max_new_tokens)  # a run that would not end in any useful time
    if not 0 <= args.temperature < math.inf or not 0 < args.top_p <= 1:  # NaN fails both: never a silent greedy run
        raise RetrofitError("--temperature must be a finite number >= 0 and --top-p in (0, 1]")
    if not -(2**63) <= args.seed < 2**64:  # what torch.manual_seed takes
        raise RetrofitError(f"--seed {args.seed} is beyond what torch takes: give a whole number from 0 to 2**63 - 1")
    from retrofit.cli.devices import check_device
    from retrofit.surgery.sources import resolve_dtype

    resolve_dtype(args.dtype)  # a dtype no model loads as fails before the model loads
    check_device(args.device)
    prompt = _read_prompt(args.prompt)

    import torch
    from transformers import TextStreamer

    from retrofit.layers.cache import RetrofitCache, cache_keyword
    from retrofit.surgery import is_converted, load_any

    model, tokenizer = load_any(args.model, dtype=args.dtype)
    if tokenizer is None:
        raise RetrofitError(f"{args.model} has no tokenizer; save one next to the weights (retrofit convert does)")
    if args.compile:
        from retrofit.decoding import compiled_decoding_support

        reason = compiled_decoding_support(model.eval())
        if reason is not None:
            raise RetrofitError(f"--compile: {reason}; run without --compile to decode it eagerly")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(device)
    torch.manual_seed(args.seed)
    inputs = _encode(tokenizer, prompt).to(device)
    cache = RetrofitCache(model) if is_converted(model) else None
    sample = args.temperature > 0
    gen_kwargs = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p) if sample else dict(do_sample=False)
    streamer = TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True)
    t0 = time.perf_counter()
    if args.compile:
        out, state_bytes = _generate_compiled(model, tokenizer, inputs["input_ids"], args, streamer)
        dt = time.perf_counter() - t0
        n_new = out.shape[1] - inputs["input_ids"].shape[1]
        if not args.quiet:  # -q: the text alone
            print(f"[{n_new} tokens in {dt:.1f}s (compilation included), {n_new / max(dt, 1e-9):.1f} tok/s, "
                  f"compiled step, state {state_bytes / 2**20:.2f} MiB for {out.shape[1]} tokens]", file=sys.stderr)
        return 0
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=args.max_new_tokens, streamer=streamer, **{cache_keyword(model.forward): cache},
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            **gen_kwargs,
        )
    dt = time.perf_counter() - t0
    n_new = out.shape[1] - inputs["input_ids"].shape[1]
    stats = f"[{n_new} tokens in {dt:.1f}s, {n_new / max(dt, 1e-9):.1f} tok/s"
    if cache is not None:
        stats += f", cache {cache.memory_bytes() / 2**20:.2f} MiB for {out.shape[1]} tokens"
    if not args.quiet:  # -q: the text alone
        print(stats + "]", file=sys.stderr)
    return 0


def _generate_compiled(model, tokenizer, input_ids, args: argparse.Namespace, streamer):
    """Greedy or sampled (transformers' temperature and top-p warpers) decoding through
    :class:`retrofit.decoding.CompiledDecoder`; stops at the model's end-of-sequence tokens.
    Returns ``(ids (1, T + new), decoding-state bytes)``."""
    import torch
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    from retrofit.decoding import CompiledDecoder

    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None} or {tokenizer.eos_token_id} - {None}
    warpers = LogitsProcessorList()
    if args.temperature > 0:
        warpers.append(TemperatureLogitsWarper(args.temperature))
        if args.top_p < 1:
            warpers.append(TopPLogitsWarper(args.top_p))
    # weights not frozen: inductor's cache then keeps the compiled graph across runs (a frozen graph,
    # a few ms per token faster, compiles anew each time: worth it for benchmarks, not for a prompt)
    decoder = CompiledDecoder(model, freeze_weights=False)
    ids = input_ids
    streamer.put(ids.cpu())
    logits = decoder.prefill(ids)
    for i in range(args.max_new_tokens):
        if args.temperature > 0:
            probs = torch.softmax(warpers(ids, logits), dim=-1)
            nxt = torch.multinomial(probs, 1)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        streamer.put(nxt.cpu())
        if int(nxt) in eos or i == args.max_new_tokens - 1:
            break
        logits = decoder.step(nxt)
    streamer.end()
    return ids, decoder.memory_bytes()


def _read_prompt(flag: str) -> str:
    """``--prompt`` (``-``: stdin) as text; bytes that are not UTF-8 (a binary file piped in, an argument in
    another encoding) are one error line, not the tokenizer's TypeError on the undecodable characters."""
    import os
    import sys

    from retrofit.errors import RetrofitError

    if flag == "-":
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream put in place of stdin (tests, embedding callers)
            return sys.stdin.read()
        raw, where = stream.read(), "stdin (--prompt -)"
    else:
        raw, where = os.fsencode(flag), "--prompt"  # argv's undecodable bytes, as the shell passed them
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RetrofitError(f"{where} is not UTF-8 text (byte {exc.start}: 0x{raw[exc.start:exc.start + 4].hex()}); "
                            "give the prompt as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _encode(tokenizer, prompt: str):
    """The prompt's ids; an empty prompt is the BOS token alone, or an error where there is none."""
    from retrofit.errors import RetrofitError

    inputs = tokenizer(prompt, return_tensors="pt")
    if inputs["input_ids"].shape[1] > 0:
        return inputs
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise RetrofitError("--prompt is empty and the tokenizer adds no BOS token, so there is nothing to continue: "
                            "give a prompt of at least one token")
    import torch

    inputs["input_ids"] = torch.tensor([[bos]])
    inputs["attention_mask"] = torch.ones(1, 1, dtype=torch.long)
    return inputs
