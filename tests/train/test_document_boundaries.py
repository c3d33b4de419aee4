"""data.document_boundaries: packed blocks get position ids that restart at each document (after
each EOS), the trainer hands them to every forward of the objective and of the held-out loss, a
recall-rewritten row stays one document, and the key off is the plain path."""
from __future__ import annotations

import pytest
import torch

from retrofit.data.packing import document_positions
from retrofit.train.data import batch_positions
from retrofit.train.objectives import Objective


def test_positions_restart_after_each_eos_and_rewritten_rows_stay_whole():
    ids = torch.tensor([[1, 5, 2, 1, 6, 7, 2, 9], [5, 5, 5, 5, 5, 5, 5, 2], [1, 2, 1, 2, 3, 3, 3, 3]])
    expected = [[0, 1, 2, 0, 1, 2, 3, 0], list(range(8)), [0, 1, 0, 1, 0, 1, 2, 3]]
    assert document_positions(ids, 2).tolist() == expected
    assert document_positions(ids[0], 2).tolist() == expected[0]  # one block (T,)
    assert batch_positions(ids, 2).tolist() == expected
    assert batch_positions(ids, 2, whole=[True]).tolist() == [list(range(8))] * 2 + expected[2:]
    assert batch_positions(ids, 2, whole=[True, False, True]) is None  # every row whole: no boundary left
    assert batch_positions(ids[1:2], 2) is None  # no boundary: the model's own positions
    assert batch_positions(ids, None) is None  # no EOS to find documents by


def test_objective_terms_with_positions_are_the_documents_alone():
    """The lm term of a block packing a document twice is the loss of the document alone (its
    first token predicted from the previous copy's end included: a block boundary's target)."""
    from tests.methods._common import perturb_new_weights, tiny_model
    from retrofit.surgery import ConversionSpec, convert

    model = convert(tiny_model("llama"), ConversionSpec(method="macchiato", window=6, sinks=1))
    perturb_new_weights(model)
    model.config.use_cache = False
    doc = torch.randint(3, 200, (1, 13), generator=torch.Generator().manual_seed(4))
    twice, pos = torch.cat([doc, doc], 1), torch.arange(13).repeat(2)[None]
    objective = Objective({"attention": 1.0, "lm": 1.0})
    _, alone = objective(model, doc)
    _, packed = objective(model, twice, position_ids=pos)
    _, unpacked = objective(model, twice)
    assert packed["attention"] == pytest.approx(alone["attention"], rel=1e-4)
    assert packed["attention"] != pytest.approx(unpacked["attention"], rel=1e-3)  # boundaries matter


@pytest.mark.parametrize("boundaries", [True, False])
def test_the_trainer_hands_document_positions_to_the_objective(converted_dir, tmp_path, monkeypatch, boundaries):
    from retrofit.train import train
    from retrofit.train.recipe import recipe_from_dict
    from tests.train import tiny

    tok = tiny.tokenizer()
    docs = [tiny.book_text(name, start=30_000 + 500 * i, chars=90) for i in range(8) for name in tiny.BOOK_NAMES]
    data = tiny.write_jsonl(tmp_path / "docs" / "train.jsonl", docs)
    seen = []
    real = Objective.__call__

    def spy(self, model, input_ids, answer_mask=None, **kw):
        seen.append((input_ids.clone(), kw.get("position_ids")))
        return real(self, model, input_ids, answer_mask=answer_mask, **kw)

    monkeypatch.setattr(Objective, "__call__", spy)
    recipe = recipe_from_dict(tiny.recipe_dict(
        converted_dir, data.parent, tmp_path / "out", data={"document_boundaries": boundaries},
        eval={"sequences": 0}, train={"objective": "mix", "objective_weights": {"lm": 1.0, "attention": 1.0},
                                      "max_steps": 2}))
    train(recipe)
    assert len(seen) == 4 and (tmp_path / "out" / "final").is_dir()
    if not boundaries:
        assert all(pos is None for _, pos in seen)
        return
    with_positions = [(ids, pos) for ids, pos in seen if pos is not None]
    assert with_positions  # ~30-token documents in 32-token blocks: most blocks pack two
    for ids, pos in with_positions:
        assert torch.equal(pos.cpu(), document_positions(ids.cpu(), tok.eos_token_id))


def test_a_recall_stream_says_which_rows_it_rewrote(tmp_path):
    """RecallSequences.rewritten is True right after a rewritten item and False after a plain one:
    the trainer reads a rewritten row as one document (its facts and answers span the block)."""
    import itertools

    from retrofit.train.data import data_files, train_stream
    from retrofit.train.recipe import recipe_from_dict
    from tests.train import tiny

    tok = tiny.tokenizer()
    docs = [tiny.book_text(name, start=30_000 + 900 * i, chars=300) for i in range(6) for name in tiny.BOOK_NAMES]
    folder = tiny.write_jsonl(tmp_path / "docs" / "train.jsonl", docs).parent
    recipes = [recipe_from_dict(tiny.recipe_dict(tmp_path / "model", folder, tmp_path / "out", data={
        "seq_len": 256, "shuffle_buffer": 0, **({"recall": {"share": 0.5, "facts": 1, "min_distance": 40}} if r else {})}))
        for r in (True, False)]
    stream = train_stream(recipes[0], tok, data_files(recipes[0]), 0, 1)[0]
    plain = itertools.islice(iter(train_stream(recipes[1], tok, data_files(recipes[1]), 0, 1)[0]), 12)
    flags = []
    for ids, ref in zip(itertools.islice(iter(stream), 12), plain):
        flags.append(stream.rewritten)
        assert stream.rewritten == (not torch.equal(ids, ref))
    assert any(flags) and not all(flags)
