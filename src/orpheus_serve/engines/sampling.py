"""On-device sampling for a batch of slots: repetition penalty, temperature, top-k, top-p, a
per-session seed, greedy at temperature 0, and the frame-position constraint of ARCHITECTURE §3.

Reproducibility whatever shares the batch: the randomness is counter-based. The noise for
token id `v` of a session is a hash of (seed, step, v), turned into a Gumbel variable, and the
token drawn is `argmax(filtered_logits / T + gumbel)` (the Gumbel-max trick, an exact draw from
the softmax of the filtered logits). No generator state is shared or advanced, so a row's
result depends only on that row: its logits, its seed and its step. All of it is torch integer
and float ops on device; as configured for CUDA (no `fast_width`, positions not passed from the
host) it has no host sync and no data-dependent shapes, so it could sit inside a CUDA graph.
On a CPU two exact shortcuts apply instead (see `sample_candidates` and `constrained_logits`).

Constrained decoding: the step of a session is also its audio position p (the prompt ends with
start_of_speech, so the first generated token is audio position 0). Only the 4096 ids of slot
p % 7 can be drawn, plus end_of_speech when p % 7 == 0. Constrained rows are sampled over that
candidate set of 4097 ids instead of the whole 156940-id vocabulary: the output projection only
computes the 7 x 4096 audio rows and end_of_speech (`constrained_logits`), and sorting for top-p
covers 4097 values, not 156940. The candidates carry their token ids, so the noise, and hence
the draw, is the one a full-vocabulary mask would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from orpheus_serve import token_format as P
from orpheus_serve.scheduler.step import SamplingParams

MASK32 = 0xFFFFFFFF


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (the `hash32` finaliser) on int64 tensors holding values in [0, 2^32).
    The multiplier is below 2^27, so products stay below 2^59: no int64 overflow on any device."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def counter_uniform(seed: Tensor, step: Tensor, token_hash: Tensor) -> Tensor:
    """Uniform noise in (0, 1), a pure function of (seed, step, token).
    seed, step [B] int64 (seed: the 64 bits of a seed in 0..2^64-1, two's complement); token_hash [B, C]
    = mix32(token id) -> [B, C] fp32."""
    row = mix32((seed & MASK32) ^ mix32(((seed >> 32) & MASK32) ^ mix32(step & MASK32)))  # [B]
    x = mix32(row.unsqueeze(1) ^ token_hash)  # [B, C]: one hash round per candidate
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in fp32, never 0 or 1


def gumbel_noise(seed: Tensor, step: Tensor, token_hash: Tensor) -> Tensor:
    return -torch.log(-torch.log(counter_uniform(seed, step, token_hash)))


def constrained_candidates(audio_positions: Tensor) -> tuple[Tensor, Tensor]:
    """Token ids a constrained row may produce, and which of them are allowed.
    audio_positions [B] -> ids [B, 4097] (slot p % 7's codes, then end_of_speech), allowed [B, 4097]."""
    phase = audio_positions % P.TOKENS_PER_FRAME  # [B]
    codes = torch.arange(P.CODEBOOK_SIZE, device=audio_positions.device)
    ids = (P.AUDIO_TOKEN_BASE + phase * P.CODEBOOK_SIZE).unsqueeze(1) + codes  # [B, 4096]
    ids = torch.cat([ids, torch.full_like(ids[:, :1], P.END_OF_SPEECH)], dim=1)  # [B, 4097]
    allowed = torch.ones_like(ids, dtype=torch.bool)
    allowed[:, -1] = phase == 0  # end_of_speech only at a frame boundary
    return ids, allowed


def constrained_logits(hidden: Tensor, output_weight: Tensor, audio_positions: Tensor,
                       host_positions: list[int] | None = None) -> Tensor:
    """Logits of the candidates of `constrained_candidates`, without the full vocabulary projection.

    hidden [B, dim]; output_weight [vocab, dim]; audio_positions [B] -> fp32 [B, 4097].
    Without host_positions: one batched matmul against the 7 x 4096 audio rows (5.5x fewer than
    the vocabulary), each row keeping the block of its own position (one weight read: what a
    memory-bound GPU wants). With the positions on the host: one matmul per position class
    present, against its 4096 rows only (7x fewer FLOPs: what a compute-bound CPU wants).
    Plus the end_of_speech row either way."""
    B = hidden.shape[0]
    audio = output_weight[P.AUDIO_TOKEN_BASE : P.AUDIO_VOCAB_END]  # [7 * 4096, dim], a contiguous view
    end = (hidden @ output_weight[P.END_OF_SPEECH]).float()  # [B]
    if host_positions is None:
        blocks = (hidden @ audio.T).float().view(B, P.TOKENS_PER_FRAME, P.CODEBOOK_SIZE)  # [B, 7, 4096]
        rows = torch.arange(B, device=hidden.device)
        own = blocks[rows, audio_positions % P.TOKENS_PER_FRAME]  # [B, 4096]
        return torch.cat([own, end.unsqueeze(1)], dim=1)
    out = torch.empty(B, P.CODEBOOK_SIZE + 1, dtype=torch.float32, device=hidden.device)
    out[:, -1] = end
    phases = [p % P.TOKENS_PER_FRAME for p in host_positions]
    classes = sorted(set(phases))
    for phase in classes:
        block = audio[phase * P.CODEBOOK_SIZE : (phase + 1) * P.CODEBOOK_SIZE]  # [4096, dim]
        if len(classes) == 1:
            out[:, :-1] = hidden @ block.T
        else:
            rows = torch.tensor([b for b, q in enumerate(phases) if q == phase], device=hidden.device)
            out[rows, :-1] = (hidden[rows] @ block.T).float()
    return out


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters, all [B] tensors on the logits' device."""

    temperature: Tensor  # fp32; <= 0 means greedy
    top_p: Tensor  # fp32 in (0, 1]
    top_k: Tensor  # int64; 0 means off
    repetition_penalty: Tensor  # fp32 >= 1
    seed: Tensor  # int64: the seed's 64 bits (seeds >= 2^63 read as negative)
    step: Tensor  # int64: tokens this session has generated so far (= its audio position)

    def select(self, rows: Tensor) -> SamplingBatch:
        return SamplingBatch(*(getattr(self, name)[rows] for name in SamplingBatch.__slots__))


def _filtered_draw(x: Tensor, token_ids: Tensor, token_hash: Tensor, params: SamplingBatch,
                   width: int) -> tuple[Tensor, Tensor]:
    """Top-k, top-p and the Gumbel draw over the `width` most likely candidates of each row.

    x [B, C]: temperature-scaled logits (-inf where not allowed). Returns the drawn ids [B] and,
    per row, whether those `width` candidates held the row's whole kept set, i.e. whether the
    draw is exact (always, when width == C). Probabilities are normalised over the top-k set,
    or over the whole row without top-k, whatever the width, so a row's draw is the same at
    any width that holds it.
    """
    C = x.shape[1]
    if width >= C:
        vals, order = x.sort(dim=1, descending=True)  # [B, C]
    else:
        vals, order = x.topk(width, dim=1)  # [B, width], sorted descending
    width = vals.shape[1]
    rank = torch.arange(width, device=x.device)
    top_k = params.top_k.unsqueeze(1)  # [B, 1]
    vals = vals.masked_fill((top_k > 0) & (rank >= top_k), -torch.inf)
    k_inside = (params.top_k > 0) & (params.top_k <= width)
    log_norm = torch.where(k_inside, vals.logsumexp(dim=1), x.logsumexp(dim=1))  # [B]
    probs = (vals - log_norm.unsqueeze(1)).exp()
    mass = probs.cumsum(dim=1)
    top_p = params.top_p.unsqueeze(1)
    # The most likely token always stays (mass before it is 0 < top_p); top_p 1 is off, exactly.
    vals = vals.masked_fill((mass - probs >= top_p) & (top_p < 1), -torch.inf)
    held = k_inside | ((params.top_k == 0) & (params.top_p < 1) & (mass[:, -1] >= params.top_p))
    token_ids, token_hash = token_ids.gather(1, order), token_hash.gather(1, order)
    noisy = vals + gumbel_noise(params.seed, params.step, token_hash)
    drawn = token_ids.gather(1, noisy.argmax(dim=1, keepdim=True)).squeeze(1)  # [B]
    return drawn, held | (width >= C)


def sample_candidates(logits: Tensor, token_ids: Tensor, token_hash: Tensor, allowed: Tensor, seen: Tensor,
                      params: SamplingBatch, *, any_random: bool = True, any_filter: bool = True,
                      fast_width: int | None = None) -> Tensor:
    """Draw one token per row among candidates.

    logits [B, C] fp32: the candidates' logits; token_ids [B, C] int64: their ids, and token_hash
    [B, C] = mix32(token_ids), on which the noise is keyed; allowed [B, C] bool; seen [B, C] bool:
    the candidate occurred in the session (prompt or generated), for the repetition penalty.
    Returns token ids [B] int64. Order as in Hugging Face generate: repetition penalty,
    temperature, top-k, top-p.

    any_random / any_filter: False when the caller knows that no row samples (all greedy) or that
    no sampling row uses top-k or top-p; the work skipped then is a no-op for every row, so a
    row's token does not depend on them (nor on anything else in the batch).
    fast_width: filter among each row's `fast_width` most likely candidates (a partial top-k,
    much cheaper than sorting C on a CPU), and sort the whole row only for the rows whose kept
    set reaches past them (one host sync). The draws are the same; None sorts every row
    (no host sync, for devices where sorting is cheap).
    """
    C = logits.shape[1]
    penalty = params.repetition_penalty.unsqueeze(1)  # [B, 1]
    x = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    x = x.masked_fill(~allowed, -torch.inf)
    greedy_ids = token_ids.gather(1, x.argmax(dim=1, keepdim=True)).squeeze(1)  # [B]
    if not any_random:
        return greedy_ids

    greedy = params.temperature <= 0
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    x = x / temperature.unsqueeze(1)
    if not any_filter:
        noisy = x + gumbel_noise(params.seed, params.step, token_hash)
        sampled_ids = token_ids.gather(1, noisy.argmax(dim=1, keepdim=True)).squeeze(1)  # [B]
    else:
        width = C if fast_width is None else min(fast_width, C)
        sampled_ids, held = _filtered_draw(x, token_ids, token_hash, params, width)
        if width < C:
            rows = (~(held | greedy)).nonzero().squeeze(1)  # host sync: which rows need the full sort
            if rows.numel():
                sampled_ids[rows] = _filtered_draw(x[rows], token_ids[rows], token_hash[rows], params.select(rows),
                                                   C)[0]
    return torch.where(greedy, greedy_ids, sampled_ids)


def needs_work(params: list[SamplingParams]) -> tuple[bool, bool]:
    """(any_random, any_filter) of `sample_candidates` for rows with these parameters."""
    random_rows = [p for p in params if not p.greedy]
    return bool(random_rows), any(p.top_k > 0 or p.top_p < 1 for p in random_rows)


class SlotSamplingState:
    """Sampling state of every slot, on device: the session's parameters and seed, and a presence
    mask of the ids it has seen (prompt + generated) for the repetition penalty."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device, *,
                 fast_width: int | None = None) -> None:
        if vocab_size < P.AUDIO_VOCAB_END:
            raise ValueError(f"vocabulary of {vocab_size} ids has no Orpheus audio tokens")
        self.vocab_size = vocab_size
        self.device = device
        self.fast_width = fast_width  # see sample_candidates
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.repetition_penalty = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.presence = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)  # [N, V]
        self.token_hash = mix32(torch.arange(vocab_size, dtype=torch.int64, device=device))  # [V]
        # Views of the audio rows, [N, 7, 4096] and [7, 4096]: a constrained row's candidates are
        # one contiguous block of each, copied whole instead of gathered id by id.
        audio = slice(P.AUDIO_TOKEN_BASE, P.AUDIO_VOCAB_END)
        self.audio_presence = self.presence[:, audio].view(num_slots, P.TOKENS_PER_FRAME, P.CODEBOOK_SIZE)
        self.audio_hash = self.token_hash[audio].view(P.TOKENS_PER_FRAME, P.CODEBOOK_SIZE)

    def reset(self, slot: int, params: SamplingParams, seed: int) -> None:
        """params as checked by `step.sampling_problem`; seed in 0..2^64-1 (stored as its 64 bits)."""
        self.temperature[slot] = max(params.temperature, 0.0)
        self.top_p[slot] = params.top_p
        self.top_k[slot] = params.top_k
        self.repetition_penalty[slot] = params.repetition_penalty
        self.seed[slot] = seed - (1 << 64) if seed >= 1 << 63 else seed
        self.presence[slot] = False

    def mark_seen(self, slots: Tensor, token_ids: Tensor) -> None:
        """slots [B], token_ids [B] (one id per row) or slots [1], token_ids [T] (prompt ids)."""
        self.presence[slots, token_ids] = True

    def batch(self, slots: Tensor, steps: Tensor) -> SamplingBatch:
        return SamplingBatch(
            temperature=self.temperature[slots],
            top_p=self.top_p[slots],
            top_k=self.top_k[slots],
            repetition_penalty=self.repetition_penalty[slots],
            seed=self.seed[slots],
            step=steps,
        )

    def sample_constrained(self, logits: Tensor, slots: Tensor, steps: Tensor,
                           params: list[SamplingParams] | None = None, *, record: bool = True) -> Tensor:
        """logits [B, 4097] from `constrained_logits` for rows at slots [B], steps [B] (= audio
        positions); `params`, the rows' parameters on the host, lets it skip no-op work.
        Returns token ids [B]; records them as seen unless `record` is False (the caller then
        calls `mark_seen` itself)."""
        token_ids, allowed = constrained_candidates(steps)  # [B, 4097]
        phase = steps % P.TOKENS_PER_FRAME
        seen = torch.cat([self.audio_presence[slots, phase], self.presence[slots, P.END_OF_SPEECH].unsqueeze(1)], 1)
        token_hash = torch.cat([self.audio_hash[phase], self.token_hash[P.END_OF_SPEECH].expand(len(steps), 1)], 1)
        any_random, any_filter = needs_work(params) if params is not None else (True, True)
        tokens = sample_candidates(logits, token_ids, token_hash, allowed, seen,
                                   self.batch(slots, steps), any_random=any_random, any_filter=any_filter,
                                   fast_width=self.fast_width)
        if record:
            self.mark_seen(slots, tokens)
        return tokens

    def sample_full(self, logits: Tensor, slots: Tensor, steps: Tensor,
                    params: list[SamplingParams] | None = None, *, record: bool = True) -> Tensor:
        """logits [B, vocab] for unconstrained rows. Returns token ids [B]; records them as seen
        unless `record` is False."""
        B, V = logits.shape
        token_ids = torch.arange(V, device=logits.device).expand(B, V)
        allowed = torch.ones_like(logits, dtype=torch.bool)
        any_random, any_filter = needs_work(params) if params is not None else (True, True)
        tokens = sample_candidates(logits, token_ids, self.token_hash.expand(B, V), allowed, self.presence[slots],
                                   self.batch(slots, steps), any_random=any_random, any_filter=any_filter,
                                   fast_width=self.fast_width)
        if record:
            self.mark_seen(slots, tokens)
        return tokens
