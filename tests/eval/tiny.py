"""Tiny offline models and tokenizers for the eval tests (no downloads)."""
from __future__ import annotations

from pathlib import Path


def _training_text() -> Path:
    """A pg-book, found the way the `pg-books` registry entry finds them (the books bundled in the package)."""
    from retrofit.eval.corpora import list_local_files, resolve_corpus

    files = list_local_files(resolve_corpus("pg-books"))
    return next((f for f in files if f.name == "complete-angler.txt"), files[0])


def train_tokenizer(vocab_size: int = 384, text_chars: int = 120_000):
    """A byte-level BPE tokenizer trained on a slice of a pg-book; adds <bos> like Llama/Gemma."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = _training_text().read_text(encoding="utf-8")[:text_chars]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    return model.eval()


def tiny_gemma3(vocab_size: int, seed: int = 0, **overrides):
    """Gemma 3 text model: sliding-window + global layers, final logit soft-capping on."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=5.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    cfg.update(overrides)
    return Gemma3ForCausalLM(Gemma3TextConfig(**cfg)).eval()


def save(model, tokenizer, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
