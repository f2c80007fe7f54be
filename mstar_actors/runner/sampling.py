"""Token sampling for one model step: logits in, one ``SampledToken`` per row out.

Pure torch, no I/O. The model runner calls ``sample_pending`` (``sample_tokens``
without the wait for the host copies) once per step on
every tensor-parallel rank with identical inputs; every rank must then draw
identical tokens (see "Randomness" below).

Order of operations (vLLM v1's sampler):

1. raw logprobs, if any row asked for them (before anything below);
2. logits processors: allowed_token_ids, bad words, min_tokens (EOS and
   stop tokens masked), logit_bias, then a spent thinking budget
   (``ThinkingBudget``: ``</think>`` alone, whatever the others allow);
3. penalties: repetition (over prompt + output tokens, HF/vLLM semantics),
   then frequency and presence (over output tokens, OpenAI semantics);
4. greedy rows (``temperature < 1e-5``) take the argmax here;
5. temperature;
6. filters: min_p, then top_k, then top_p (min_p and top_k both keep a
   prefix of the tokens sorted by probability, so they commute; top_p runs
   last on the renormalised survivors);
7. softmax and a draw (below).

Logprobs: we return the *raw* logprobs, ``log_softmax`` of the model's logits
before penalties, temperature and filters: vLLM v1's default
(``logprobs_mode="raw_logprobs"``), so a logprob describes the model, not the
request's sampling knobs. ``logprobs_mode="processed"`` gives the log_softmax
of the logits the token was actually drawn from instead (filtered tokens then
read as the floor below). Values are clamped to ``MIN_LOGPROB`` (-9999.0, what
OpenAI reports for impossible tokens) so that -inf and NaN never reach JSON.

Randomness: on CUDA the exponential race ``argmax(probs / q)`` with ``q ~
Exp(1)`` per token draws exactly from ``Categorical(probs)``. We prefer it to
``torch.multinomial`` because (a) it needs no host synchronisation on CUDA,
(b) ``q`` for different rows can come from different seeds and the argmax
stays one batched op, and (c) a row's draw depends only on its own ``q``
row, never on its batch position. It runs as Triton kernels
(``sampling_triton``), with temperature and top_k's floor, each ``q`` from
Philox keyed by the row's seed. On CPU, where a vocabulary's exponentials
cost about 20 ns each (0.9 ms a row of 49,152), an unseeded row draws one
uniform ``u`` instead and takes the first token whose cumulative
probability passes ``u``: (b) and (c) hold as well. A seeded row races on
CPU too: a batch's logits differ from a lone row's in their last bits, and
the inverse distribution turns such a difference into another token
whenever ``u`` falls among unlikely tokens (a percent or two of steps),
where the race changes its pick only between near-equal ``probs / q``. A
seeded row's seed is ``derive_seed(seed, len(output_token_ids))`` (on CPU
it reseeds one generator that fills its ``q``): the same request draws the
same token at the same output length whatever else is in the batch, and a
preempted request that restarts with its earlier outputs reproduces the
rest. Unseeded rows share one generator
(``generator``, or a per-device module generator seeded with
``DEFAULT_SHARED_SEED``; on CUDA one draw of it a step, the base seed);
ranks stay in lockstep because each samples the same rows in the same order.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np
import torch

from mstar_actors import messages

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)
CPU_CANDIDATES = 256  # tokens ``apply_top_k_top_p`` sorts first on CPU
MIN_LOGPROB = -9999.0
DEFAULT_SHARED_SEED = 0
_MASK64 = (1 << 64) - 1

_shared_generators: dict[torch.device, torch.Generator] = {}


@dataclass
class SampleRow:
    """A sampled row: its request, and its prompt and output lists (the
    sequence's own, so a row kept from step to step stays current)."""

    request_id: str
    params: messages.SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    plain: bool = field(init=False)  # no penalty, logprobs or logits processor, whatever the outputs
    thinking: ThinkingBudget | None = field(init=False)  # its thinking budget's count (None: no budget)

    def __post_init__(self) -> None:
        self.plain = _is_plain(self.params)
        self.thinking = ThinkingBudget.of(self.params, self.prompt_token_ids)


@dataclass
class ThinkingBudget:
    """A row's reasoning held to ``SamplingParams.thinking_budget`` tokens, as
    vLLM's ``thinking_token_budget``: the tokens after a ``<think>`` the prompt
    left open (a template's generation prompt that opens it) or the output
    wrote count; once there are ``budget`` of them and no ``</think>`` came,
    ``</think>`` is the one token the row may sample. A later ``<think>``
    opens another reasoning, counted anew. The count reads the row's outputs
    as they grow (each token once)."""

    budget: int
    open_id: int
    close_id: int
    count: int = -1  # tokens inside the open reasoning (-1: none open)
    seen: int = 0  # outputs counted

    @classmethod
    def of(cls, params: messages.SamplingParams, prompt_token_ids: list[int]) -> ThinkingBudget | None:
        if params.thinking_budget is None or len(params.think_ids) != 2:
            return None
        budget = cls(params.thinking_budget, *params.think_ids)
        last_open, last_close = (_last_index(prompt_token_ids, tag) for tag in (budget.open_id, budget.close_id))
        if last_open > last_close:  # the prompt left it open: the tokens after it count
            budget.count = len(prompt_token_ids) - 1 - last_open
        return budget

    def end(self) -> None:
        """The reasoning ended where the count did not see it (a grammar read a ``</think>`` written in pieces):
        nothing more to hold."""
        self.count = -1

    def spent(self, output_token_ids: list[int]) -> bool:
        """Whether the next token must be ``</think>``."""
        if len(output_token_ids) < self.seen:  # (outputs are never taken back; were they, no count would stand)
            raise ValueError("a row's outputs shrank under its thinking budget")
        self._read(output_token_ids[self.seen:])
        self.seen = len(output_token_ids)
        return self.count >= self.budget

    def _read(self, tokens: list[int]) -> None:
        for token in tokens:
            if token == self.open_id:
                self.count = 0
            elif token == self.close_id:
                self.count = -1
            elif self.count >= 0:
                self.count += 1


def _last_index(tokens: list[int], token: int) -> int:
    """The index of ``token``'s last place in ``tokens``, -1 where it has none (a search in C: a long prompt
    is read once, at the row's start)."""
    try:
        return len(tokens) - 1 - tokens[::-1].index(token)
    except ValueError:
        return -1


@dataclass
class _Plan:
    """What the batch needs, decided once from the rows (host side)."""

    is_greedy: list[bool]
    needs_penalties: bool
    needs_logprobs: bool
    needs_processors: bool = False

    @classmethod
    def from_rows(cls, rows: list[SampleRow]) -> _Plan:
        is_greedy = [r.params.temperature < SAMPLING_EPS for r in rows]
        if all(r.plain for r in rows):
            return cls(is_greedy=is_greedy, needs_penalties=False, needs_logprobs=False)
        return cls(
            is_greedy=is_greedy,
            needs_penalties=any(_has_penalty(r.params) for r in rows),
            needs_logprobs=any(r.params.logprobs is not None for r in rows),
            needs_processors=any(_has_processor(r) for r in rows),
        )

    @property
    def is_all_greedy(self) -> bool:
        return all(self.is_greedy)


def sample_tokens(
    logits: torch.Tensor,
    rows: list[SampleRow],
    *,
    generator: torch.Generator | None = None,
    logprobs_mode: Literal["raw", "processed"] = "raw",
) -> list[messages.SampledToken]:
    """logits [len(rows), vocab] (any float dtype; compute in float32) -> one SampledToken per row, in order.

    ``generator`` drives the unseeded rows (default: a per-device module
    generator). The caller's ``logits`` tensor is never modified.
    """
    return sample_pending(logits, rows, generator=generator, logprobs_mode=logprobs_mode).result()


class PendingSample:
    """One step's draws on their way to the host.

    ``token_ids`` (``[rows]`` int64) stays on the logits' device, where the
    next step's inputs may read it before the host does; the host copies
    (token ids, and the logprobs when a row asked for them) are started at
    once without waiting (pinned memory on CUDA) and ``result()`` waits for
    them: the step's one synchronisation. ``ready()`` says, without
    waiting, whether ``result()`` would not block; ``wait()`` blocks until
    it would not (another thread may call it: it holds no lock of ours).
    """

    def __init__(self, rows: list[SampleRow], token_ids: torch.Tensor, logprobs: torch.Tensor | None = None,
                 dead: torch.Tensor | None = None):
        self.rows = rows
        self.token_ids = token_ids
        parts = (token_ids,) if logprobs is None else (token_ids, *_logprob_parts(rows, token_ids, logprobs))
        is_cuda = token_ids.device.type == "cuda"
        # A copy on CPU too: ``token_ids`` may be a graph's static output, which the next step rewrites.
        self._host = [t.to("cpu", non_blocking=is_cuda, copy=True) for t in parts]
        # rows whose processors left no token (``_dead_rows``), None when no row has a processor
        self._dead = None if dead is None else dead.to("cpu", non_blocking=is_cuda, copy=True)
        self.dead_rows: set[int] = set()  # rows whose grammar allowed no token (``with_dead_rows``)
        self._copied: torch.cuda.Event | None = None
        if is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def ready(self) -> bool:
        return self._copied is None or self._copied.query()

    def wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def result(self) -> list[messages.SampledToken]:
        self.wait()
        if len(self._host) == 1:
            tokens = _to_sampled(self.rows, self._host[0].tolist())
        else:
            tokens = _to_sampled_with_logprobs(self.rows, *(t.tolist() for t in self._host))
        dead = set(self.dead_rows)
        if self._dead is not None:
            dead.update(i for i, is_dead in enumerate(self._dead.tolist()) if is_dead)
        return _marked_dead(tokens, dead) if dead else tokens


def with_dead_rows(draws: list[messages.SampledToken] | PendingSample,
                   rows: list[int]) -> list[messages.SampledToken] | PendingSample:
    """``draws`` with ``rows`` marked dead (their grammar allows no token:
    ``SampledToken.dead``), beside any their processors left dead."""
    if isinstance(draws, PendingSample):
        draws.dead_rows.update(rows)
        return draws
    return _marked_dead(draws, set(rows))


def _marked_dead(tokens: list[messages.SampledToken], rows: set[int]) -> list[messages.SampledToken]:
    return [msgspec.structs.replace(t, dead=True) if i in rows else t for i, t in enumerate(tokens)]


def sample_pending(
    logits: torch.Tensor,
    rows: list[SampleRow],
    *,
    generator: torch.Generator | None = None,
    logprobs_mode: Literal["raw", "processed"] = "raw",
) -> PendingSample:
    """``sample_tokens`` up to its host copies: the draws as a ``PendingSample``."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"sample_tokens: logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}"
        )
    plan = _Plan.from_rows(rows)
    plain = not (plan.needs_penalties or plan.needs_logprobs or plan.needs_processors)
    if plan.is_all_greedy and plain:
        # The common case: one argmax, no float32 copy (the cast is exact).
        return PendingSample(rows, greedy_tokens(logits))
    if plain and _races(logits) and not _filters_in_torch(rows, plan):
        # temperature and top_k in the kernel, off the model's own logits
        return PendingSample(rows, _race_tokens(logits, rows, plan, generator, raw=True))
    logits = logits.to(torch.float32, copy=True)
    raw_logprobs = _log_softmax(logits) if plan.needs_logprobs and logprobs_mode == "raw" else None
    dead = None
    if plan.needs_processors:
        apply_logits_processors(logits, rows)
        dead = _dead_rows(logits)
    if plan.needs_penalties:
        apply_penalties(logits, rows)
    token_ids, final_logits = _choose_tokens(logits, rows, plan, generator)
    if not plan.needs_logprobs:
        return PendingSample(rows, token_ids, dead=dead)
    return PendingSample(rows, token_ids, raw_logprobs if raw_logprobs is not None else _log_softmax(final_logits),
                         dead=dead)


# --------------------------------------------------------------------------
# Logits processors
# --------------------------------------------------------------------------


def _has_processor(row: SampleRow) -> bool:
    return _has_fixed_processor(row.params) or _is_below_min_tokens(row) or _must_close(row)


def _has_fixed_processor(p: messages.SamplingParams) -> bool:
    """A processor whatever the outputs (min_tokens' lasts until they are enough)."""
    return bool(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids)


def _is_plain(p: messages.SamplingParams) -> bool:
    """No penalty, logprobs or logits processor, whatever the outputs."""
    return not (_has_penalty(p) or p.logprobs is not None or _has_fixed_processor(p)
                or (p.min_token_stop_ids and p.min_tokens > 0) or p.thinking_budget is not None)


def _is_below_min_tokens(row: SampleRow) -> bool:
    return bool(row.params.min_token_stop_ids) and len(row.output_token_ids) < row.params.min_tokens


def _must_close(row: SampleRow) -> bool:
    return row.thinking is not None and row.thinking.spent(row.output_token_ids)


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """In place on float32 ``logits``: allowed_token_ids, then the banned tokens
    (bad words, min_tokens' stop ids), then logit_bias, then a spent thinking
    budget's ``</think>`` (the row's one finite logit, 0, whatever the others
    left). Each is one indexed op over the rows that ask for it; the index
    lists are built on the host from the rows alone, so every rank applies
    the same ones."""
    vocab = logits.shape[1]
    _apply_allowed(logits, rows, vocab)
    banned = [(i, t) for i, r in enumerate(rows) for t in _banned_tokens(r) if 0 <= t < vocab]
    _index_put(logits, banned, [float("-inf")] * len(banned), accumulate=False)
    bias = [((i, t), b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if 0 <= t < vocab]
    _index_put(logits, [ix for ix, _ in bias], [b for _, b in bias], accumulate=True)
    closing = [(i, r.thinking.close_id) for i, r in enumerate(rows) if _must_close(r)]
    if closing:
        at = _host_to(logits.device, [i for i, _ in closing], torch.int64)
        logits.index_fill_(0, at, float("-inf"))
        _index_put(logits, closing, [0.0] * len(closing), accumulate=False)
    return logits


def _dead_rows(logits: torch.Tensor) -> torch.Tensor:
    """Rows no token is left in (every logit -inf): their processors, on top of
    a grammar's mask, exclude each other. Only a processor's -inf can do it
    (a grammar always allows its stop tokens); the row's draw is a stand-in."""
    return logits.amax(dim=-1) == float("-inf")


def _apply_allowed(logits: torch.Tensor, rows: list[SampleRow], vocab: int) -> None:
    idx = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
    if not idx:
        return
    allowed = torch.zeros((len(idx), vocab), dtype=torch.bool, device=logits.device)
    pairs = [(j, t) for j, i in enumerate(idx) for t in rows[i].params.allowed_token_ids if 0 <= t < vocab]
    _index_put(allowed, pairs, [True] * len(pairs), accumulate=False)
    at = _host_to(logits.device, idx, torch.int64)
    logits.index_copy_(0, at, logits.index_select(0, at).masked_fill_(~allowed, float("-inf")))


def _banned_tokens(row: SampleRow) -> list[int]:
    """vLLM's bad words: a word's last token is banned where the output ends
    with the word's other tokens; min_tokens bans the stop ids until reached."""
    out = row.output_token_ids
    banned = [word[-1] for word in row.params.bad_words_token_ids
              if len(word) == 1 or (len(out) >= len(word) - 1 and list(out[len(out) - len(word) + 1:]) == list(word[:-1]))]
    if _is_below_min_tokens(row):
        banned += row.params.min_token_stop_ids
    return banned


def _index_put(target: torch.Tensor, pairs: list[tuple[int, int]], values: list, accumulate: bool) -> None:
    if not pairs:
        return
    index = _host_to(target.device, pairs, torch.int64).T
    target.index_put_((index[0], index[1]), _host_to(target.device, values, target.dtype), accumulate=accumulate)


# --------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------


def _has_penalty(p: messages.SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """In place on float32 ``logits``; returns it.

    repetition (r): over tokens seen in prompt or output, ``l / r`` if ``l > 0``
    else ``l * r``; then ``l -= frequency * count_in_output`` and
    ``l -= presence * (count_in_output > 0)``. Only rows with a penalty are touched.
    """
    idx = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not idx:
        return logits
    device, vocab = logits.device, logits.shape[1]
    sub_rows = [rows[i] for i in idx]
    at = _host_to(device, idx, torch.int64)
    sub = logits.index_select(0, at)
    output_counts = _token_counts([r.output_token_ids for r in sub_rows], vocab, device)
    if any(r.params.repetition_penalty != 1.0 for r in sub_rows):
        rep = _row_tensor([r.params.repetition_penalty for r in sub_rows], device)
        prompt_counts = _token_counts([r.prompt_token_ids for r in sub_rows], vocab, device)
        seen = (prompt_counts + output_counts) > 0
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
    freq = _row_tensor([r.params.frequency_penalty for r in sub_rows], device)
    presence = _row_tensor([r.params.presence_penalty for r in sub_rows], device)
    sub = sub - freq * output_counts - presence * (output_counts > 0).to(sub.dtype)
    return logits.index_copy_(0, at, sub)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32 occurrence counts; ids outside the vocab are ignored.

    The lists go to the device as one flat buffer (``array`` is several times
    faster than ``torch.tensor`` on long Python lists) and are counted with one
    ``index_add_``; ``output_size`` keeps ``repeat_interleave`` free of a sync.
    """
    flat = array("q")
    for tokens in token_lists:
        flat.extend(tokens)
    num_rows, width = len(token_lists), vocab + 1  # the last column takes out-of-range ids
    counts = torch.zeros(num_rows * width, dtype=torch.float32, device=device)
    if flat:
        tokens = _host_to(device, torch.frombuffer(flat, dtype=torch.int64))
        tokens = torch.where((tokens >= 0) & (tokens < vocab), tokens, vocab)
        lengths = _host_to(device, [len(t) for t in token_lists], torch.int64)
        row_starts = torch.arange(num_rows, device=device) * width
        tokens += torch.repeat_interleave(row_starts, lengths, output_size=len(flat))
        counts.index_add_(0, tokens, torch.ones(len(flat), dtype=torch.float32, device=device))
    return counts.view(num_rows, width)[:, :vocab]


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    """A [rows, 1] float32 column, broadcastable against [rows, vocab]."""
    return _host_to(device, values, torch.float32).unsqueeze(1)


def _host_to(device: torch.device, values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) as a tensor on ``device``. On
    CUDA through pinned memory, queued without waiting: a copy from pageable
    memory would wait for every kernel queued before it, the step's own."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# --------------------------------------------------------------------------
# Choosing tokens
# --------------------------------------------------------------------------


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit (a NaN counts as largest), as ``argmax``.
    On CPU by ``max``'s kernel: ``argmax``'s took three times as long over
    SmolLM2's 49,152 logits (0.51 against 0.17 ms at 8 rows, 2.05 against
    0.73 at 32, one thread), ~1-2% of a decode step; the same indices."""
    return logits.max(dim=-1).indices if logits.device.type == "cpu" else logits.argmax(dim=-1)


def _choose_tokens(
    logits: torch.Tensor,
    rows: list[SampleRow],
    plan: _Plan,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [rows] and the logits they were drawn from (for processed
    logprobs). ``logits`` is ``sample_pending``'s float32 copy, changed in
    place: on CPU each fresh [rows, vocab] tensor costs as much as the pass
    that fills it."""
    # NaN from the model would poison argmax and softmax; treat it as impossible.
    logits = logits.nan_to_num_(nan=float("-inf"), neginf=float("-inf"))
    if plan.is_all_greedy:
        return greedy_tokens(logits), logits
    races = _races(logits)
    greedy = None if races else greedy_tokens(logits)
    device = logits.device
    # Greedy rows get temperature 1 so the batched math stays finite; their
    # random draw is discarded below.
    temps = [1.0 if g else r.params.temperature for g, r in zip(plan.is_greedy, rows)]
    if any(t != 1.0 for t in temps):
        logits.div_(_row_tensor(temps, device))
    # Greedy rows' draws are discarded: their filters are not applied.
    apply_min_p(logits, [0.0 if g else r.params.min_p for g, r in zip(plan.is_greedy, rows)])
    logits = apply_top_k_top_p(logits, [0 if g else r.params.top_k for g, r in zip(plan.is_greedy, rows)],
                               [1.0 if g else r.params.top_p for g, r in zip(plan.is_greedy, rows)])
    if races:
        return _race_tokens(logits, rows, plan, generator, raw=False), logits
    probs = _safe_softmax(logits)
    drawn = _draw(probs, rows, plan, generator)
    # A row with no finite logit has all-zero probs: fall back to its argmax.
    drawn = torch.where(probs.sum(dim=-1) > 0, drawn, greedy)
    is_greedy = _host_to(device, plan.is_greedy, torch.bool)
    return torch.where(is_greedy, greedy, drawn), logits


def apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """In place: drop tokens whose probability is below ``min_p * max_prob`` (0 = off)."""
    if not any(m > 0.0 for m in min_ps):
        return logits
    probs = _safe_softmax(logits)
    threshold = probs.amax(dim=-1, keepdim=True) * _row_tensor(min_ps, logits.device)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """In place: keep the ``top_k`` most likely tokens (0 = off), then the
    smallest set whose probability reaches ``top_p`` (1.0 = off), each as a
    threshold on the row's logits, so ties at either boundary are kept (as
    vLLM keeps them at top_k's). Always keeps the most likely token.

    Both are read off the row's tokens sorted by logit: on CUDA all of them
    (one sort); on CPU, where sorting 49,152 tokens takes about 1.5 ms a row,
    the top ``CPU_CANDIDATES`` (``topk``, or the largest top_k; top_k alone
    takes only that), and a whole sort only for the rows whose nucleus spills
    past them."""
    use_k = any(k > 0 for k in top_ks)
    use_p = any(p < 1.0 for p in top_ps)
    if not use_k and not use_p:
        return logits
    device, vocab = logits.device, logits.shape[1]
    ks = [min(k, vocab) if k > 0 else 0 for k in top_ks]
    width = vocab if device.type != "cpu" else min(vocab, max(CPU_CANDIDATES if use_p else 1, *ks))
    top = logits.topk(width, dim=-1).values if width < vocab else logits.sort(dim=-1, descending=True).values
    k_col = _host_to(device, ks, torch.int64).unsqueeze(1)
    threshold = torch.where(k_col > 0, top.gather(1, k_col.clamp(min=1) - 1), float("-inf"))
    if not use_p:
        return logits.masked_fill_(logits < threshold, float("-inf"))
    ps = _row_tensor([p if p < 1.0 else float("inf") for p in top_ps], device)
    # top_p's probabilities are over the whole row, after top_k.
    lse = logits.masked_fill(logits < threshold, float("-inf")).logsumexp(dim=-1, keepdim=True)
    nucleus, spills = _nucleus(top, threshold, lse, ps)
    if width < vocab and bool(spills.any()):
        rows = spills.nonzero()[:, 0]
        whole = logits.index_select(0, rows).sort(dim=-1, descending=True).values
        nucleus[rows] = _nucleus(whole, threshold[rows], lse[rows], ps[rows])[0]
    threshold = torch.where(ps <= 1.0, torch.maximum(threshold, nucleus), threshold)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _nucleus(top: torch.Tensor, threshold: torch.Tensor, lse: torch.Tensor,
             ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """top_p's threshold ``[rows, 1]`` for rows whose tokens sorted by logit
    begin with ``top`` (top_k's ``threshold`` applied, ``lse`` the row's
    normaliser after it), and which rows' nuclei spill past ``top`` ``[rows]``."""
    probs = torch.exp(top.masked_fill(top < threshold, float("-inf")) - lse).nan_to_num_(nan=0.0)
    mass = probs.cumsum(dim=-1)
    kept = ((mass - probs) < ps).to(torch.int32).cumprod(dim=-1).sum(dim=-1, keepdim=True).clamp_(min=1)
    return top.gather(1, kept - 1), ((mass[:, -1:] < ps) & (ps <= 1.0)).squeeze(1)


def _safe_softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax that maps an all -inf (or +inf-poisoned) row to zeros, not NaN."""
    return torch.softmax(logits, dim=-1).nan_to_num_(nan=0.0)


def _races(logits: torch.Tensor) -> bool:
    return races_on(logits.device)


def races_on(device: torch.device) -> bool:
    """Whether a draw on ``device`` is ``sampling_triton.race``'s: on CUDA, where Triton is."""
    return device.type == "cuda" and _race_kernel() is not None


def _race_kernel():
    try:
        from mstar_actors.runner import sampling_triton
    except ImportError:  # pragma: no cover - a CUDA build of torch has Triton
        return None
    return sampling_triton


def _filters_in_torch(rows: list[SampleRow], plan: _Plan) -> bool:
    """Whether a random row has min_p or top_p, which read the tempered
    probabilities (torch, before the kernel); top_k is a floor on the logits."""
    return any(not g and (r.params.min_p > 0.0 or r.params.top_p < 1.0) for g, r in zip(plan.is_greedy, rows))


# A request's draw as the race kernel's inputs: 1 / temperature, floor, seed (None: unseeded).
RaceRow = tuple[float, float, "int | None"]
GREEDY_ROW: RaceRow = (1.0, float("inf"), None)  # keeps no token: the argmax


@dataclass
class RaceRows:
    """A step's draw as ``sampling_triton.race``'s inputs alone, on the host:
    per row 1 / temperature, floor (+inf: a greedy row keeps no token, so
    takes its argmax; -inf: every token) and seed (``UNSEEDED``: the step's
    base seed). What a captured step's draw reads (``step_graphs``)."""

    scales: np.ndarray  # float32
    floors: np.ndarray  # float32
    seeds: np.ndarray  # int64


def race_row(params: messages.SamplingParams) -> RaceRow | None:
    """A request's draw as the race kernel's inputs alone, or None where it
    needs torch first: penalties, logits processors, logprobs, top_k, top_p,
    min_p, a grammar. Fixed for the request's life (a runner keeps it)."""
    p = params
    if not _is_plain(p) or p.structured is not None:
        return None
    if p.temperature < SAMPLING_EPS:
        return GREEDY_ROW
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
        return None
    return (1.0 / p.temperature, float("-inf"), p.seed)


def race_rows(rows: list[RaceRow], num_outputs: list[int]) -> RaceRows:
    """A step's ``RaceRows`` from its rows' ``race_row``s; ``num_outputs``:
    each row's output tokens, counting one the host has not read yet (a
    seeded row's seed is ``derive_seed(seed, it)``)."""
    scales, floors, seeds = zip(*rows)
    seeded = [i for i, seed in enumerate(seeds) if seed is not None]
    out = np.full(len(rows), _race_kernel().UNSEEDED, dtype=np.int64)
    if seeded:
        out[seeded] = derive_seeds([seeds[i] for i in seeded], [num_outputs[i] for i in seeded])
    return RaceRows(np.array(scales, dtype=np.float32), np.array(floors, dtype=np.float32), out)


def _race_tokens(logits: torch.Tensor, rows: list[SampleRow], plan: _Plan, generator: torch.Generator | None,
                 *, raw: bool) -> torch.Tensor:
    """``sampling_triton.race``'s tokens ``[rows]`` on the logits' device.
    ``raw``: the model's logits, which the kernel tempers and floors at top_k
    (else ``_choose_tokens``' tempered and filtered copy). A random row
    unseeded takes the step's base seed, one draw of the shared generator on
    the device; a seeded one ``derive_seed``'s, as ``_row_draws``."""
    kernel = _race_kernel()
    device = logits.device
    # A row's 1 / temperature, its floor (+inf: a greedy row keeps no token, so takes its argmax) and top_k.
    params = [[1.0 if g or not raw else 1.0 / r.params.temperature for g, r in zip(plan.is_greedy, rows)],
              [float("inf") if g else float("-inf") for g in plan.is_greedy],
              [float(0 if g or not raw else r.params.top_k) for g, r in zip(plan.is_greedy, rows)]]
    seeds = [kernel.UNSEEDED if g or r.params.seed is None else derive_seed(r.params.seed, len(r.output_token_ids))
             for g, r in zip(plan.is_greedy, rows)]
    scales, floors, ks = _host_to(device, params, torch.float32)
    seeds_dev = _host_to(device, seeds, torch.int64)
    max_k = min(int(max(params[2])), logits.shape[1])
    if max_k > 0:  # the k-th largest logit, the least a top_k row keeps (ties kept); NaN is -inf (torch ranks it first)
        top = logits.masked_fill(logits.isnan(), float("-inf")).topk(max_k, dim=-1).values
        at = ks.to(torch.int64).clamp_(min=1, max=max_k) - 1
        floors = torch.where(ks > 0, top.gather(1, at.unsqueeze(1)).squeeze(1).to(torch.float32), floors)
    if any(s == kernel.UNSEEDED and not g for s, g in zip(seeds, plan.is_greedy)):
        shared = generator if generator is not None else shared_generator(device)
        base = torch.randint(0, 1 << 62, (1,), generator=shared, device=device)
    else:  # no row reads it: the shared generator does not advance
        base = seeds_dev[:1]
    return kernel.race(logits, scales, floors, seeds_dev, base)


def _draw(probs: torch.Tensor, rows: list[SampleRow], plan: _Plan, generator: torch.Generator | None) -> torch.Tensor:
    """A token a row from ``probs`` (see "Randomness" in the module doc): on
    CUDA without Triton the exponential race (with it, ``_race_tokens``); on
    CPU the race for seeded rows, and for the others the inverse of the
    row's cumulative distribution at one uniform (float64 sums: the last
    token's share is exact to its own rounding), which costs a fraction of
    the vocabulary's exponentials there (0.05 against 0.9 ms a row of 49,152
    tokens)."""
    seeded = [i for i, r in enumerate(rows) if not plan.is_greedy[i] and r.params.seed is not None]
    if probs.device.type != "cpu" or len(seeded) == len(rows):
        return _race(probs, _row_draws(rows, plan.is_greedy, probs.shape, probs.device, generator,
                                       torch.Tensor.exponential_))
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    is_seeded = set(seeded)
    skip = [greedy or i in is_seeded for i, greedy in enumerate(plan.is_greedy)]  # the seeded race below
    u = _row_draws(rows, skip, (len(rows), 1), probs.device, generator, torch.Tensor.uniform_, torch.float64)
    # Strictly below the total, so the first cumulative sum past it is a token of non-zero probability.
    at = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, at, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    if seeded:
        part = [rows[i] for i in seeded]
        q = _row_draws(part, [False] * len(part), (len(part), probs.shape[1]), probs.device, generator,
                       torch.Tensor.exponential_)
        tokens[seeded] = _race(probs[seeded], q)
    return tokens


def _race(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``argmax(probs / q)`` a row: with ``q ~ Exp(1)`` a token, drawn from ``probs``."""
    # exponential_ may return exactly 0 in float32; 0 would make probs/q inf or NaN.
    return (probs / q.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def _row_draws(rows: list[SampleRow], skip: list[bool], shape, device: torch.device,
               generator: torch.Generator | None, fill, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[rows, n]`` of ``dtype`` filled row by row by ``fill(tensor, generator=...)``;
    seeded rows from their own reseeded generator, the others from the shared
    one; rows to ``skip`` (greedy ones) draw nothing (ones), so they never advance it."""
    q = torch.ones(shape, dtype=dtype, device=device)
    unseeded = [i for i, r in enumerate(rows) if not skip[i] and r.params.seed is None]
    if unseeded:
        shared = generator if generator is not None else shared_generator(device)
        q[unseeded] = fill(torch.empty((len(unseeded), shape[1]), dtype=dtype, device=device), generator=shared)
    seeded = [i for i, r in enumerate(rows) if not skip[i] and r.params.seed is not None]
    if seeded:
        # One generator, reseeded per row: on CUDA the seed is read when the
        # kernel is launched, so reseeding for the next row is safe.
        row_gen = torch.Generator(device=device)
        for i in seeded:
            row_gen.manual_seed(derive_seed(rows[i].params.seed, len(rows[i].output_token_ids)))
            fill(q[i], generator=row_gen)
    return q


def derive_seed(seed: int, num_output_tokens: int) -> int:
    """A 63-bit generator seed for one step of a seeded request (splitmix64 mix)."""
    return int(derive_seeds([seed], [num_output_tokens])[0])


def derive_seeds(seeds: list[int], num_output_tokens: list[int]) -> np.ndarray:
    """``derive_seed`` of each pair, as int64, in uint64 arithmetic (wrapping: the mask)."""
    with np.errstate(over="ignore"):
        x = np.array([seed & _MASK64 for seed in seeds], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x += np.array(num_output_tokens, dtype=np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return ((x ^ (x >> np.uint64(31))) >> np.uint64(1)).astype(np.int64)


def shared_generator(device: torch.device, seed: int | None = None) -> torch.Generator:
    """The module generator for unseeded rows on ``device``; ``seed`` reseeds it."""
    device = torch.device(device)
    gen = _shared_generators.get(device)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(DEFAULT_SHARED_SEED)
        _shared_generators[device] = gen
    if seed is not None:
        gen.manual_seed(seed)
    return gen


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.log_softmax(torch.nan_to_num(logits, nan=float("-inf")), dim=-1)
    return torch.nan_to_num(out, nan=MIN_LOGPROB).clamp_(min=MIN_LOGPROB)


def _to_sampled(rows: list[SampleRow], token_ids: list[int]) -> list[messages.SampledToken]:
    return [messages.SampledToken(r.request_id, t) for r, t in zip(rows, token_ids)]


def _logprob_parts(rows: list[SampleRow], token_ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The chosen tokens' logprobs ``[rows]`` and the top ``max k`` of each row (values, ids), on the device."""
    max_k = min(max(r.params.logprobs or 0 for r in rows), logprobs.shape[1])
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(max_k, dim=-1)
    return chosen, top_values, top_ids


def _to_sampled_with_logprobs(
    rows: list[SampleRow], ids: list[int], chosen: list[float], top_values: list[list[float]], top_ids: list[list[int]]
) -> list[messages.SampledToken]:
    out = []
    for i, r in enumerate(rows):
        if r.params.logprobs is None:
            out.append(messages.SampledToken(r.request_id, ids[i]))
            continue
        k = r.params.logprobs
        tops = tuple(messages.TopLogprob(t, v) for t, v in zip(top_ids[i][:k], top_values[i][:k]))
        out.append(messages.SampledToken(r.request_id, ids[i], chosen[i], tops))
    return out
