"""Tiny offline pieces for the training tests: a BPE tokenizer, text files, converted models, recipes."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from retrofit.data.paths import bundled_data_dir

BOOKS = bundled_data_dir() / "pg-books"  # the public-domain books that ship in the package
BOOK_NAMES = ("complete-angler.txt", "devils-dictionary.txt", "moby-dick.txt", "pride-and-prejudice.txt")
VOCAB = 320


def book_text(name: str = "moby-dick.txt", start: int = 20_000, chars: int = 40_000) -> str:
    return (BOOKS / name).read_text(encoding="utf-8")[start:start + chars]


@functools.lru_cache(maxsize=1)
def tokenizer():
    """Byte-level BPE (VOCAB tokens) trained on a slice of a book; adds <bos> like Llama/Gemma."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([book_text(chars=100_000)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def write_books(folder: Path, n: int = 4, chars: int = 6_000) -> Path:
    """``n`` short .txt files cut from different public-domain books (one document each)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        name = BOOK_NAMES[i % len(BOOK_NAMES)]
        (folder / f"{i:02d}-{name}").write_text(book_text(name, start=30_000 + 7_000 * (i // len(BOOK_NAMES)), chars=chars))
    return folder


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def base_model(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


CONVERSION = {"method": "macchiato", "window": 8, "latents": 8, "init_swa_share": 0.5, "chunk_size": 16}


def save_base(folder: Path, seed: int = 0) -> Path:
    """A tiny random Llama + tokenizer as an ordinary (unconverted) transformers folder."""
    if not (folder / "config.json").is_file():
        model = base_model(seed)
        model.save_pretrained(folder)
        tokenizer().save_pretrained(folder)
    return folder


def save_converted(folder: Path, seed: int = 0, **conversion) -> Path:
    """The tiny Llama converted to Macchiato and saved with ``retrofit.surgery.save``."""
    from retrofit import surgery

    if not (folder / "config.json").is_file():
        model = surgery.convert(base_model(seed), surgery.ConversionSpec(**{**CONVERSION, **conversion}))
        surgery.save(model, folder, tokenizer=tokenizer())
    return folder


def recipe_dict(model_dir: Path, data_dir: Path, out_dir: Path, **sections) -> dict:
    """A small CPU recipe: seq 32, batch 4 (micro 2 x accumulation 2), ZeRO-2, fp32."""
    d = {
        "model": {"name": str(model_dir)},
        "conversion": dict(CONVERSION),
        "trainable": {"mode": "new"},
        "data": {"files": str(data_dir), "seq_len": 32, "shuffle_buffer": 8, "seed": 0},
        "eval": {"sequences": 4},
        "train": {"max_steps": 6, "batch_size": 4, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 2,
                  "gradient_checkpointing": True, "precision": "fp32", "seed": 0},
        "deepspeed": {"config": "deepspeed/zero2.json"},
        "checkpoint": {"output_dir": str(out_dir), "save_every": 3, "keep_last": 2, "resume": "auto"},
        "logging": {"every": 1, "tensorboard": False, "progress": False},
    }
    for section, values in sections.items():
        d.setdefault(section, {})
        if section == "conversion" and values.get("method", CONVERSION["method"]) != CONVERSION["method"]:
            d[section] = {}  # another method: the Macchiato keys would not apply to it (an error)
        d[section] = {**d[section], **values} if isinstance(values, dict) else values
    return d
