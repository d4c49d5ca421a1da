"""Document masks: with document_ids, attention never crosses a document boundary."""

from __future__ import annotations

import dataclasses

import torch

from meshloom.models.llama3 import LLAMA3_FLAVORS, Transformer


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=64)).eval()


def _packed(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.cat([first, second])[None]
    ids = torch.cat([torch.zeros(len(first), dtype=torch.int32), torch.ones(len(second), dtype=torch.int32)])[None]
    return tokens, ids


@torch.no_grad()
def test_masked_documents_do_not_see_each_other():
    model = _model()
    g = torch.Generator().manual_seed(1)
    doc_a, doc_b = torch.randint(0, 64, (10,), generator=g), torch.randint(0, 64, (14,), generator=g)
    other_a = torch.randint(0, 64, (10,), generator=g)
    tokens, ids = _packed(doc_a, doc_b)
    edited, _ = _packed(other_a, doc_b)

    masked = model(tokens, document_ids=ids)
    masked_edit = model(edited, document_ids=ids)
    # Editing document A leaves every logit of document B unchanged...
    torch.testing.assert_close(masked[:, 10:], masked_edit[:, 10:], rtol=0, atol=0)
    # ...which is a property of the mask: without it B reads A.
    plain, plain_edit = model(tokens), model(edited)
    assert (plain[:, 10:] - plain_edit[:, 10:]).abs().max() > 1e-3

    # Each packed document gets the logits it would get alone (RoPE scores depend only on distances).
    torch.testing.assert_close(masked[:, :10], model(doc_a[None]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked[:, 10:], model(doc_b[None]), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_one_document_mask_equals_plain_causal_attention():
    model = _model()
    tokens = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(2))
    same = torch.zeros(3, 20, dtype=torch.int64)
    torch.testing.assert_close(model(tokens, document_ids=same), model(tokens), rtol=1e-5, atol=1e-5)


def test_masked_backward_keeps_gradients_inside_documents():
    model = _model()
    tokens, ids = _packed(torch.arange(8), torch.arange(8, 20))
    embedded = model.tok_embeddings(tokens).detach().requires_grad_()
    model.tok_embeddings, saved = None, model.tok_embeddings  # feed hidden states to see their gradient
    try:
        logits = model(embedded, document_ids=ids)
        logits[0, 8:].sum().backward()  # a loss on document B only
    finally:
        model.tok_embeddings = saved
    assert embedded.grad[0, :8].abs().max() == 0
    assert embedded.grad[0, 8:].abs().max() > 0
