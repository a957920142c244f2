"""The token scorer (``loss.score_tokens`` / ``chunked_token_scores``) equals a float64 full-vocabulary
``log_softmax``: log-probabilities, entropies and the gradients of both, at temperatures 1.0 and 0.6,
with padding, uneven response lengths and chunks that do and do not divide the token count; and it
never makes a ``[tokens, vocab]`` block beyond its chunk, nor holds more than one (two with the
entropy) at once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model
from infir2.loss import chunked_token_scores, score_tokens
from infir2.rl.batch import RLBatch
from infir2.rl.update import response_logprobs
from live_bytes import LiveBytes

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers


def _reference(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Float64, the full ``[tokens, vocab]`` log-softmax: the definition the scorer must meet."""
    logp_all = F.log_softmax((h.double() @ w.double().t()) / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[..., None])[..., 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _inputs(tokens: int = 37, hidden: int = 48, vocab: int = 301, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.25  # peaked enough that T matters
    return h, w, torch.randint(0, vocab, (tokens,), generator=g), torch.randn(tokens, generator=g)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 8, 37, 100])  # 8 does not divide 37; 37 and 100 are one chunk
def test_fp32_scores_and_grads_match_the_fp64_reference(temperature: float, chunk: int) -> None:
    h, w, targets, mix = _inputs()
    h, w = h.requires_grad_(), w.requires_grad_()
    logp, ent = chunked_token_scores(h, w, targets, temperature, chunk, entropy=True)
    assert ent is not None and logp.dtype == ent.dtype == torch.float32
    (logp * mix).sum().add((ent * mix.flip(0)).sum()).backward()  # both outputs' gradients, weighted
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_logp, ref_ent = _reference(h64, w64, targets, temperature)
    (ref_logp * mix.double()).sum().add((ref_ent * mix.flip(0).double()).sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    assert h.grad is not None and w.grad is not None
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fp64_inputs_are_scored_in_fp64(temperature: float) -> None:
    """An fp64 model (the golden runs') keeps fp64 math: the reference to 1e-12, gradients of the
    log-probabilities alone and of the entropy alone."""
    h, w, targets, mix = _inputs(tokens=20)
    for which in ("logp", "entropy"):
        hc, wc = h.double().requires_grad_(), w.double().requires_grad_()
        logp, ent = chunked_token_scores(hc, wc, targets, temperature, 6, entropy=True)
        assert ent is not None and logp.dtype == torch.float64
        ((logp if which == "logp" else ent) * mix.double()).sum().backward()
        hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
        ref_logp, ref_ent = _reference(hr, wr, targets, temperature)
        ((ref_logp if which == "logp" else ref_ent) * mix.double()).sum().backward()
        torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(hc.grad, hr.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(wc.grad, wr.grad, rtol=1e-10, atol=1e-12)


def test_bf16_logits_as_the_head_gives_them() -> None:
    """Under bf16 autocast the logits are the bf16 GEMM's, upcast: as the plain path's ``(h @ W.T).float()``."""
    h, w, targets, _ = _inputs(tokens=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = chunked_token_scores(h, w, targets, 0.6, 16, entropy=True)
        plain_logits = (h @ w.t()).float()
    plain = F.log_softmax(plain_logits / 0.6, dim=-1)
    assert ent is not None and logp.dtype == torch.float32
    torch.testing.assert_close(logp, plain.gather(-1, targets[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, -(plain.exp() * plain).sum(-1), rtol=1e-5, atol=1e-5)


def _responses(vocab: int, seed: int = 3) -> RLBatch:
    """Three prompts of uneven length (left-padded) with responses of 9, 4 and 13 tokens (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 2, 7)]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (9, 4, 13)]
    return RLBatch.of_responses(prompts, responses, pad_id=0)


def _model_reference(model, rows, temperature: float):
    """Float64 full-vocabulary scores of each response token from the model's own logits (an fp64 copy)."""
    ref = make_tiny_model(vocab_size=model.config.vocab_size, hidden=model.config.hidden_size).double()
    ref.load_state_dict(model.state_dict())
    r = rows.response_mask.shape[1]
    positions = (rows.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = ref(input_ids=rows.ids, attention_mask=rows.attention_mask, position_ids=positions).logits
    logp_all = F.log_softmax(logits[:, -r - 1 : -1] / temperature, dim=-1)
    logp = logp_all.gather(-1, rows.ids[:, -r:, None])[..., 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1), ref


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_rl_response_scores_match_the_fp64_model(temperature: float) -> None:
    """RL's scoring of padded, uneven responses (chunked at 5 tokens, which divides none of the rows,
    and unchunked) equals the float64 model's full log-softmax on every real response token; the
    gradient reaching the parameters through the log-probabilities matches too."""
    model = make_tiny_model(vocab_size=300, hidden=64)
    rows = _responses(300).rows([0, 1, 2])
    real = rows.response_mask.bool()
    ref_logp, ref_ent, ref = _model_reference(model, rows, temperature)
    (ref_logp * real).sum().backward()
    r = rows.response_mask.shape[1]
    positions = (rows.attention_mask.cumsum(-1) - 1).clamp(min=0)
    for chunk in (5, None):
        model.zero_grad()
        logp, ent = score_tokens(
            model,
            rows.ids,
            rows.ids[:, -r:],
            r,
            attention_mask=rows.attention_mask,
            position_ids=positions,
            temperature=temperature,
            entropy=True,
            chunk_tokens=chunk,
        )
        assert ent is not None
        torch.testing.assert_close(logp[real].double(), ref_logp[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent[real].double(), ref_ent[real], rtol=1e-5, atol=1e-5)
        (logp * real).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_rl_scoring_is_chunked_under_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the budget RL's ``response_logprobs`` makes no ``[B, R, V]`` logits: the model's head is
    never run (its output would be the full block), and the largest fp32 block the scorer allocates is
    a chunk's; the numbers equal the unchunked path's."""
    import infir2.loss.scorer as scorer

    model = make_tiny_model(vocab_size=300, hidden=64)
    rows = _responses(300).rows([0, 1, 2])
    with torch.no_grad():
        plain, plain_ent = response_logprobs(model, rows, 0.6, "fp32", entropy=True)
        monkeypatch.setattr(scorer, "AUTO_CHUNK_BYTES", 4 * 300 * 4)  # 4 tokens' fp32 logits
        seen: list[tuple[int, ...]] = []
        real_logits = scorer._logits

        def logits(*args):
            z = real_logits(*args)
            seen.append(tuple(z.shape))
            return z

        monkeypatch.setattr(scorer, "_logits", logits)
        calls = []
        hook = model.lm_head.register_forward_hook(lambda _m, _i, out: calls.append(out.shape))
        chunked, ent = response_logprobs(model, rows, 0.6, "fp32", entropy=True)
        hook.remove()
    assert all(shape[1] == 0 for shape in calls)  # the head ran on no position
    assert seen and max(s[0] for s in seen) == 4  # [4, V] blocks, 3 x 13 tokens scored
    real = rows.response_mask.bool()
    assert ent is not None and plain_ent is not None
    torch.testing.assert_close(chunked[real], plain[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent[real], plain_ent[real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunks_vocabulary_block_alive_at_a_time(entropy: bool, dtype: torch.dtype) -> None:
    """The ``[*, V]`` bytes the scorer holds at once, counted per allocation, in forward and in backward:
    one fp32 ``[chunk, V]`` block (each made in place of the last, freed before the next chunk's logits),
    two where the entropy or its gradient needs ``p`` beside ``logp``; under bf16 autocast the head's
    bf16 logits (half a block) beside the first fp32 block, the bf16 gradient beside the last. (The
    backward of 0dae9d9..b41cd12 held three fp32 blocks: ``p`` beside the logits, and the previous
    chunk's gradient while the next chunk's logits were made.)"""
    tokens, vocab, hidden, chunk = 64, 4096, 8, 16
    h, w, targets, mix = _inputs(tokens, hidden, vocab)
    h, w = h.requires_grad_(), w.requires_grad_()
    block = chunk * vocab * 4
    blocks = 2 if entropy else 1
    forward, backward = LiveBytes(vocab, hidden), LiveBytes(vocab, hidden)
    with forward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logp, ent = chunked_token_scores(h, w, targets, 0.6, chunk, entropy=entropy)
    loss = (logp * mix).sum() + (0 if ent is None else (ent * mix.flip(0)).sum())
    with backward:
        loss.backward()
    half = block // 2 if dtype == torch.bfloat16 else 0
    bound = max(blocks * block, block + half)
    assert forward.peak == bound, forward.peak / block
    assert backward.peak == bound, backward.peak / block
