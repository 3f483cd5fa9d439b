"""The sampler on its own: the counter-based noise, the distribution it draws from, the filters,
the repetition penalty, batch independence and the frame-position constraint."""

from __future__ import annotations

import pytest
import torch

from orpheus_serve import token_format as P
from orpheus_serve.engines.sampling import (
    SamplingBatch,
    SlotSamplingState,
    constrained_candidates,
    constrained_logits,
    counter_uniform,
    mix32,
    sample_candidates,
)
from orpheus_serve.scheduler.step import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def batch_params(n: int, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, penalty: float = 1.0,
                 seed: torch.Tensor | None = None, step: torch.Tensor | None = None) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((n,), temperature),
        top_p=torch.full((n,), top_p),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        repetition_penalty=torch.full((n,), penalty),
        seed=torch.arange(n, dtype=torch.int64) * 7919 + 11 if seed is None else seed,
        step=torch.zeros(n, dtype=torch.int64) if step is None else step,
    )


def draw(logits: torch.Tensor, n: int, **kwargs: float) -> torch.Tensor:
    """n draws from one row of logits [C], each row of the batch with its own seed."""
    C = logits.shape[0]
    ids = torch.arange(C).expand(n, C)
    return sample_candidates(logits.expand(n, C), ids, mix32(ids), torch.ones(n, C, dtype=torch.bool),
                             torch.zeros(n, C, dtype=torch.bool), batch_params(n, **kwargs))


def test_counter_uniform_is_uniform_and_keyed_on_every_input() -> None:
    seeds = torch.tensor([0, 1, 2**40 + 5], dtype=torch.int64)
    steps = torch.tensor([0, 0, 3], dtype=torch.int64)
    ids = torch.arange(50_000).expand(3, 50_000)
    u = counter_uniform(seeds, steps, mix32(ids))
    assert ((u > 0) & (u < 1)).all()
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50, chi2  # 19 degrees of freedom: p < 1e-4 above 45
    neighbours = torch.stack([u[:, :-1].reshape(-1), u[:, 1:].reshape(-1)])  # adjacent token ids
    assert abs(torch.corrcoef(neighbours)[0, 1].item()) < 0.02
    again = counter_uniform(seeds, steps, mix32(ids))
    assert torch.equal(u, again)
    other_step = counter_uniform(seeds, steps + 1, mix32(ids))
    assert (u != other_step).float().mean() > 0.99
    assert (u[0] != u[1]).float().mean() > 0.99


def test_draws_follow_the_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    tokens = draw(logits, n, temperature=0.7)
    freq = torch.bincount(tokens, minlength=6).float() / n
    expected = torch.softmax(logits / 0.7, 0)
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma + 1e-4).all(), (freq, expected)


def test_top_k_and_top_p_keep_only_their_set() -> None:
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, 1.0])
    n = 20_000
    top_k = torch.bincount(draw(logits, n, top_k=3), minlength=6).float() / n
    assert top_k[[3, 4, 5]].sum() == 0
    expected = torch.softmax(logits[:3], 0)
    assert ((top_k[:3] - expected).abs() < 0.02).all()

    probs = torch.softmax(logits, 0)  # sorted: 0, 1, 2, 5, 3, 4
    top_p = 0.8  # the smallest prefix with mass >= 0.8 is {0, 1, 2}
    assert probs[[0, 1]].sum() < top_p <= probs[[0, 1, 2]].sum()
    kept = torch.bincount(draw(logits, n, top_p=top_p), minlength=6)
    assert kept[[3, 4, 5]].sum() == 0 and (kept[:3] > 0).all()


def test_greedy_and_repetition_penalty() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.9, -0.5]])
    ids = torch.arange(4).unsqueeze(0)
    allowed = torch.ones(1, 4, dtype=torch.bool)
    unseen = torch.zeros(1, 4, dtype=torch.bool)
    greedy = batch_params(1, temperature=0.0, penalty=1.1)
    assert sample_candidates(logits, ids, mix32(ids), allowed, unseen, greedy).item() == 1
    seen = torch.tensor([[False, True, False, False]])  # 3.0 / 1.1 < 2.9
    assert sample_candidates(logits, ids, mix32(ids), allowed, seen, greedy).item() == 2
    # Negative logits are multiplied: a seen -0.5 becomes less likely, never more.
    neg = torch.tensor([[-0.5, -0.52, -5.0, -6.0]])
    seen0 = torch.tensor([[True, False, False, False]])
    assert sample_candidates(neg, ids, mix32(ids), allowed, seen0, greedy).item() == 1


def test_a_row_draws_the_same_alone_and_in_a_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    B, C = 12, 300
    logits = torch.randn(B, C, generator=gen) * 2
    ids = torch.randint(0, P.VOCAB_SIZE, (B, C), generator=gen)
    allowed = torch.rand(B, C, generator=gen) > 0.1
    seen = torch.rand(B, C, generator=gen) > 0.8
    params = SamplingBatch(
        temperature=torch.tensor([0.6, 0.0, 1.3] * 4), top_p=torch.tensor([0.8, 1.0, 0.5, 0.95] * 3),
        top_k=torch.tensor([0, 5, 0, 50] * 3), repetition_penalty=torch.tensor([1.1, 1.3] * 6),
        seed=torch.arange(B) * 1_000_003, step=torch.arange(B) * 5)
    together = sample_candidates(logits, ids, mix32(ids), allowed, seen, params)
    partial = sample_candidates(logits, ids, mix32(ids), allowed, seen, params, fast_width=8)
    assert torch.equal(partial, together)
    for b in range(B):
        rows = torch.tensor([b])
        one = sample_candidates(logits[rows], ids[rows], mix32(ids[rows]), allowed[rows], seen[rows],
                                params.select(rows), fast_width=8)
        assert one.item() == together[b].item()
        assert allowed[b][(ids[b] == together[b]).nonzero()].all()


def test_partial_top_k_filtering_draws_what_the_full_sort_draws() -> None:
    """fast_width: rows whose kept set fits in the top `fast_width` are filtered there, the rest
    are sorted whole; every row draws what sorting every row draws."""
    gen = torch.Generator().manual_seed(2)
    B, C = 400, 4097
    scale = torch.tensor([0.5, 3.0, 10.0, 40.0]).repeat(B // 4).unsqueeze(1)  # flat ... peaked rows
    logits = torch.randn(B, C, generator=gen) * scale
    ids = torch.arange(C).expand(B, C) + 128266
    allowed = torch.ones(B, C, dtype=torch.bool)
    allowed[::3, -1] = False
    seen = torch.rand(B, C, generator=gen) > 0.95
    params = SamplingBatch(
        temperature=torch.tensor([0.6, 1.0, 0.0, 1.4, 0.8]).repeat(B // 5),
        top_p=torch.tensor([0.8, 0.95, 1.0, 0.5, 0.99, 0.8, 1.0]).repeat(B // 7 + 1)[:B],
        top_k=torch.tensor([0, 0, 5, 0, 50, 0, 100, 0, 16, 17, 0]).repeat(B // 11 + 1)[:B],
        repetition_penalty=torch.full((B,), 1.1), seed=torch.arange(B) * 31 + 7, step=torch.arange(B) % 9)
    full = sample_candidates(logits, ids, mix32(ids), allowed, seen, params)
    fast = sample_candidates(logits, ids, mix32(ids), allowed, seen, params, fast_width=16)
    assert torch.equal(full, fast)
    assert len(set(full.tolist())) > 100  # really random draws, not all the argmax


def test_constrained_sampling_keeps_each_position_in_its_slot() -> None:
    """Random candidate logits with end_of_speech made likely: every drawn token lies in its
    position's slot, end_of_speech only at frame boundaries, so every sequence is whole frames."""
    num_slots, steps = 48, 50
    state = SlotSamplingState(num_slots, P.VOCAB_SIZE, torch.device("cpu"))
    for slot in range(num_slots):
        state.reset(slot, SamplingParams(temperature=1.0, top_p=1.0, seed=slot), seed=slot)
    slots = torch.arange(num_slots)
    gen = torch.Generator().manual_seed(0)
    sequences: list[list[int]] = [[] for _ in range(num_slots)]
    for step in range(steps):
        logits = torch.randn(num_slots, P.CODEBOOK_SIZE + 1, generator=gen)
        logits[:, -1] += 10.0  # end_of_speech: likelier than all 4096 codes together
        tokens = state.sample_constrained(logits, slots, torch.full((num_slots,), step))
        for seq, token in zip(sequences, tokens.tolist(), strict=True):
            if not seq or seq[-1] != P.END_OF_SPEECH:
                seq.append(token)
    ended = 0
    for seq in sequences:
        for position, token in enumerate(seq):
            if token == P.END_OF_SPEECH:
                assert position % 7 == 0 and position == len(seq) - 1
                ended += 1
            else:
                lo, hi = P.slot_token_range(position)
                assert lo <= token < hi
        parser = P.FrameParser()
        frames = parser.feed_many(seq)
        if parser.ended:
            assert parser.dropped_tokens == 0 and len(frames) * 7 == len(seq) - 1
    assert ended == num_slots  # every sequence took the likely stop at a frame boundary
    assert max(len(seq) for seq in sequences) > 1  # and they did not all stop at position 0


def test_constrained_logits_equal_the_full_projection_at_the_candidates() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(P.VOCAB_SIZE, 16, generator=gen)
    hidden = torch.randn(9, 16, generator=gen)
    positions = torch.arange(9) * 3 + 1
    ids, allowed = constrained_candidates(positions)
    full = hidden @ weight.T
    torch.testing.assert_close(constrained_logits(hidden, weight, positions), full.gather(1, ids))
    by_position = constrained_logits(hidden, weight, positions, positions.tolist())
    torch.testing.assert_close(by_position, full.gather(1, ids))
    one_class = torch.full((9,), 15)  # every row at the same position class
    torch.testing.assert_close(constrained_logits(hidden, weight, one_class, one_class.tolist()),
                               full.gather(1, constrained_candidates(one_class)[0]))
    assert allowed[:, -1].tolist() == [(p % 7 == 0) for p in positions.tolist()]
    assert all(ids[i, 0].item() == P.slot_token_range(p)[0] for i, p in enumerate(positions.tolist()))
    assert (ids[:, -1] == P.END_OF_SPEECH).all()


def test_no_int64_overflow_in_the_hash() -> None:
    x = torch.tensor([0, 1, 2**32 - 1, 2**31, 123456789], dtype=torch.int64)
    h = mix32(x)
    assert ((h >= 0) & (h < 2**32)).all()
    # Reference: the same hash in Python's unbounded integers.
    def ref(v: int) -> int:
        v = ((v >> 16) ^ v) * 0x45D9F3B & 0xFFFFFFFF
        v = ((v >> 16) ^ v) * 0x45D9F3B & 0xFFFFFFFF
        return (v >> 16) ^ v
    assert h.tolist() == [ref(v) for v in x.tolist()]
