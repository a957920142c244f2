"""The chunked linear + cross-entropy equals the plain F.cross_entropy on full logits (values, grads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model
from infir2.loss import AUTO_CHUNK_BYTES, chunk_tokens_for, linear_cross_entropy_sum, lm_loss_sum

IGNORE = -100


def _inputs(dtype: torch.dtype, tokens: int = 37, hidden: int = 48, vocab: int = 301, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[torch.rand(tokens, generator=g) < 0.3] = IGNORE
    return h, w, labels


def _reference(h, w, labels):
    """The plain loss, in float64 (the chunked loss must land within fp32 round-off of it)."""
    logits = h.double() @ w.double().t()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_fp32_loss_and_grads_match_plain_cross_entropy(chunk: int) -> None:
    h, w, labels = _inputs(torch.float32)
    loss = linear_cross_entropy_sum(h, w, labels, IGNORE, chunk)
    loss.backward()
    h2, w2 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _reference(h2, w2, labels)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w2.grad, rtol=1e-5, atol=1e-6)
    assert (h.grad[labels == IGNORE] == 0).all()  # ignored tokens get no gradient


def test_bf16_inputs_as_close_to_exact_as_the_plain_bf16_path() -> None:
    """bf16 hidden/weight: the loss equals the unchunked bf16 GEMM + fp32 upcast + F.cross_entropy;
    the gradients are no further from the fp64 gradients (of the same bf16 inputs) than its are."""
    h, w, labels = _inputs(torch.bfloat16, tokens=64)
    loss = linear_cross_entropy_sum(h, w, labels, IGNORE, 16)
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    plain = F.cross_entropy((h2 @ w2.t()).float(), labels, ignore_index=IGNORE, reduction="sum")
    plain.backward()
    h3, w3 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    _reference(h3, w3, labels).backward()
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-4)
    for ours, theirs, exact in ((h.grad, h2.grad, h3.grad), (w.grad, w2.grad, w3.grad)):
        err_ours, err_plain = (ours.double() - exact).norm(), (theirs.double() - exact).norm()
        assert err_ours <= 1.5 * err_plain, (err_ours, err_plain)
        assert err_ours <= 1e-2 * exact.norm()


def test_all_ignored_gives_zero_loss_and_grads() -> None:
    h, w, labels = _inputs(torch.float32)
    labels[:] = IGNORE
    loss = linear_cross_entropy_sum(h, w, labels, IGNORE, 8)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


@pytest.mark.parametrize("tied", [False, True])
def test_lm_loss_sum_matches_the_model_logits(tied: bool) -> None:
    """On a tiny Qwen2 (tied and untied lm_head): chunked == plain loss and parameter gradients."""
    model = make_tiny_model(vocab_size=300, hidden=64)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = IGNORE
    grads = []
    for chunk in (None, 7):
        model.zero_grad()
        loss = lm_loss_sum(model, ids, labels, chunk_tokens=chunk, ignore_index=IGNORE)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, g_plain), (chunked, g_chunked) = grads
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-5)
    assert g_plain.keys() == g_chunked.keys()
    for name in g_plain:
        torch.testing.assert_close(g_chunked[name], g_plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_chunk_tokens_for_setting() -> None:
    assert chunk_tokens_for(None, 10**6, 10**6) is None
    assert chunk_tokens_for(0, 10**6, 10**6) is None
    assert chunk_tokens_for(512, 4, 4) == 512
    assert chunk_tokens_for("auto", 8192, 151936) is not None  # 5 GB of fp32 logits
    assert chunk_tokens_for("auto", 256, 300) is None
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        chunk_tokens_for(-1, 4, 4)


@pytest.mark.parametrize("vocab", [300, 32000, 151936, 262144, 10**6])
def test_auto_keeps_one_chunks_logits_bounded_whatever_the_vocabulary(vocab) -> None:
    """The largest fp32 logits block the loss makes (a chunk, or the whole micro-batch) stays under the budget."""
    for tokens in (1, 128, 2048, 8192, 32768, 131072):
        chunk = chunk_tokens_for("auto", tokens, vocab)
        block = tokens if chunk is None else min(chunk, tokens)
        assert block * vocab * 4 <= max(AUTO_CHUNK_BYTES, vocab * 4), (tokens, chunk)  # >= one token's row
        assert chunk is None or chunk < tokens  # chunked only when the whole logits would not fit
    assert chunk_tokens_for("auto", 8192, 151936) == 441  # 256 MiB / (151936 * 4 bytes)
