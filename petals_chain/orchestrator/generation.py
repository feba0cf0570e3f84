"""Generation: the decode loop (sample, feed, repeat) and requests of ``n >= 1`` choices, each its own job.

:class:`GenerationMixin` holds these methods of :class:`~petals_chain.orchestrator.core.Orchestrator`; the LM
head and sampling run batched in the head's worker thread (``HeadBatcher``), the relay in
:class:`~petals_chain.orchestrator.failover.ChainHolder`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import torch

from petals_chain.algorithms.speculative import DraftLength, ngram_draft
from petals_chain.orchestrator.deadlines import DEADLINE
from petals_chain.orchestrator.dispatch import ADMISSION, PLACE, RequestPlaces
from petals_chain.orchestrator.drafting import DraftState
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.orchestrator.sampling import SamplingParams, SequenceSampler, StopMatcher, TokenChoice
from petals_chain.swarm.aio import gather_or_cancel


@dataclass
class Generation:
    """Result of one generation."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    wait_s: float
    service_s: float
    chain: list[str]
    failovers: int
    logprobs: list[TokenChoice] | None = None  # per generated token, when asked for
    prompt_logprobs: list[TokenChoice | None] | None = None  # per prompt token (first: None), when asked for
    forked: bool = False  # started from a sibling's prefill (n > 1) instead of its own
    cached_tokens: int = 0  # prompt tokens whose KV was not computed for this request (prefix cache, held KV)


# emit(text, token choices since the previous emit): streaming callbacks get the text that is safe to show and
# the tokens (with logprobs when asked) whose text starts in what has been shown (a token held back with its text
# comes with it; one past a stop string never comes); text may be empty while a stop string is still possible.
Emit = Callable[[str, list[TokenChoice]], Awaitable[None]]


class GenerationMixin:
    """The generation methods of the Orchestrator (it provides ``batcher``, ``stats``, ``planner``, ``tokenizer``,
    ``cfg``, ``_eos``, ``validate_prompt``, ``_max_tokens`` and ``_background``)."""

    async def _decode_loop(self, holder: ChainHolder, context: list[int], hidden: torch.Tensor,
                           params: SamplingParams, emit: Emit | None, generated: list[int] | None = None
                           ) -> tuple[list[int], str, str, list[TokenChoice]]:
        """Sample, feed, repeat: ``hidden`` is the last block's output after ``context``; returns (tokens,
        text, finish_reason, choices). The tokens are appended to ``generated`` as they come (the caller's list:
        a job cut off or failed is charged what it generated). The LM head, sampling and the next token's embedding
        run batched in the head's worker thread (:class:`HeadBatcher`); this loop only relays.

        With speculative decoding (``params.speculative`` or ``--speculative``: ``ngram``) each relay step feeds
        the token just sampled together with up to k prompt-lookup drafts; the head keeps the drafts the model's
        own choices confirm (``verify_drafts``) and the chain's KV is rolled back past the rest (the next step
        overwrites those positions). With a structured output (``params.structured``) every step samples from the
        tokens its grammar allows, and drafts are cut where the grammar stops taking them.

        ``choices`` are the tokens the text shows (a stop token has none): a stop string cuts the text, and the tokens
        whose text starts at or past the cut are left out of them (their text is not in the answer; OpenAI still
        bills them: they stay in ``tokens``). A token the cut goes through stays: the text it starts is in the answer,
        and its logprob is what chose that text. A stream sends each token with the text it starts, so that the
        tokens it sent are ``choices``."""
        seq = SequenceSampler(params, context)
        matcher = StopMatcher(self.tokenizer, params.stop, context, unless=params.stop_unless)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        generated = [] if generated is None else generated
        choices: list[TokenChoice] = []
        starts: list[int] = []  # where each of ``choices`` starts in the text (a partial character's: where it does)
        unsent: list[tuple[int, TokenChoice]] = []  # (start, choice) of the tokens no emit carried yet

        def ready(upto: int) -> list[TokenChoice]:
            """Take the unsent tokens that start before character ``upto``."""
            nonlocal unsent
            k = next((i for i, (at, _) in enumerate(unsent) if at >= upto), len(unsent))
            out, unsent = [c for _, c in unsent[:k]], unsent[k:]
            return out
        finish = "length"
        limit = min(params.max_tokens, holder.max_length - len(context))
        deadline = DEADLINE.get()
        mode = params.speculative or self.cfg.speculative
        drafts = DraftLength(k=self.cfg.speculative_k) if mode in ("ngram", "draft") else None
        draft_state = DraftState() if mode == "draft" else None
        if limit <= 0:
            if deadline is not None:  # nothing to generate: the answer's first (and last) part is ready now
                deadline.first_token()
            return generated, "", finish, choices
        choice, emb = await self.batcher.sample(hidden, seq)
        seq.append(choice.token)
        pending = [choice]
        while True:
            done = False
            for choice in pending:
                if not generated and deadline is not None:
                    deadline.first_token()
                tok = choice.token
                generated.append(tok)
                holder.charge_output()
                if tok in stop_ids:  # not in the text, so not in its logprobs either (OpenAI's)
                    finish, done = "stop", True
                    break
                choices.append(choice)
                starts.append(len(matcher.text))
                unsent.append((starts[-1], choice))
                delta = matcher.feed(tok)
                if delta and emit is not None:
                    await emit(delta, ready(matcher.emitted))
                if matcher.stopped:
                    finish, done = "stop", True
                    break
                if len(generated) >= limit:
                    done = True
                    break
            if done:
                break
            tok = generated[-1]
            # drafts never reach past the last token this request may generate (its pages hold exactly that)
            k = min(drafts.k, limit - len(generated) - 1) if drafts else 0
            if draft_state is not None:
                draft = await self.drafter.draft(draft_state, context + generated, k, seq.grammar)
            else:
                draft = ngram_draft(context + generated, k) if k > 0 else []
            if draft and seq.grammar is not None:  # what the grammar forbids would be rejected: not sent at all
                draft = draft[:seq.grammar.valid_prefix(draft)]
            if draft:
                outs = await holder.feed([tok] + draft, all_positions=True, drafted=len(draft))
                pending, emb = await self.batcher.verify(outs, seq, draft)
                accepted = len(pending) - 1
                drafts.update(len(draft), accepted)
                self.stats.add_speculation(len(draft), accepted)
                holder.sync(context + generated + draft[:accepted])  # the rejected drafts' KV is overwritten next
            else:
                hidden = await holder.feed([tok], emb)
                choice, emb = await self.batcher.sample(hidden, seq)
                seq.append(choice.token)
                pending = [choice]
        tail = matcher.flush()
        if matcher.stopped:  # a stop string (or one the last, incomplete character had held back) cut the text
            finish = "stop"
            cut = len(matcher.text)
            choices = [c for c, at in zip(choices, starts) if at < cut]
            last = ready(cut)
        else:
            last = ready(len(matcher.text) + 1)  # all: a token that adds no text (an ignored EOS) starts at the end
        if emit is not None and (tail or last):
            await emit(tail, last)
        self.stats.relay_steps += holder.steps
        return generated, matcher.text, finish, choices

    def check_speculative(self, params: SamplingParams) -> None:
        """A request for draft-model speculation needs a draft model (400 before any chain is taken)."""
        if params.speculative == "draft" and self.drafter is None:
            raise RequestError("speculative 'draft' needs an orchestrator started with --speculative draft:MODEL",
                               param="speculative")

    def _finish_job(self, holder: ChainHolder, t0: float, generated: int, prompt_tokens: int, ok: bool) -> float:
        """Record a finished job (or turn) and return its service time."""
        service = max(0.0, time.monotonic() - t0 - holder.wait_s)
        self.stats.record(wait_s=holder.wait_s, service_s=service, tokens=generated, prompt_tokens=prompt_tokens,
                          ok=ok, batch=holder.mean_batch, served=holder.admitted, whole_request=False)
        if ok and self.planner is not None:
            self.planner.observe_job(holder.steps)
        return service

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, explicit_max_tokens: bool = True,
                       emit: Emit | None = None, prompt_logprobs: int | None = None) -> Generation:
        """One request as one job: queue for a chain, prefill, decode, release the chain."""
        return (await self.generate_n(prompt_ids, [params], explicit_max_tokens, [emit] if emit else None,
                                      prompt_logprobs=prompt_logprobs))[0]

    async def generate_n(self, prompt_ids: list[int], params: list[SamplingParams], explicit_max_tokens: bool = True,
                         emits: list[Emit | None] | None = None, *, prompt_logprobs: int | None = None,
                         settle: bool = True, scored: Callable[[list], Awaitable[None]] | None = None,
                         ) -> list[Generation]:
        """``len(params)`` completions of one prompt, each its own job. The first job prefills; the others
        wait for that prefill and start from a copy of its KV when JFFC puts them on the same chain (else
        they prefill on theirs): the prompt is computed once, and every choice samples its first token from
        the same last hidden state. If one choice fails, the others are cancelled and their chains released.
        ``settle=False``: the request's deadline is settled by the caller (a request of several prompts, when its
        last one is done). ``scored(prompt_logprobs)`` is awaited once the prompt is scored, before any choice
        emits a token (a stream that echoes its prompt with logprobs opens with them)."""
        self.validate_prompt(prompt_ids, params[0].max_tokens, explicit_max_tokens)
        self.check_speculative(params[0])
        params = [SamplingParams(**{**p.__dict__, "stop": list(p.stop), "max_tokens": self._max_tokens(
            p.max_tokens, len(prompt_ids), self.cfg.max_length, explicit_max_tokens)}) for p in params]
        emits = list(emits or [None] * len(params))
        # the request this is (a part of): the places its prompts share, counted once when its last part ends
        adm = ADMISSION.get()
        places = adm.places if adm is not None else RequestPlaces()
        if prompt_logprobs is None and all(p.max_tokens == 0 for p in params):  # nothing to compute: no chain taken
            deadline = DEADLINE.get()
            if deadline is not None:
                deadline.first_token()
                if settle:
                    self.deadlines.settle(deadline)
            self.stats.begin_request_part(places)
            self.stats.end_request_part(places, None)
            return [Generation(token_ids=[], text="", finish_reason="length", prompt_tokens=len(prompt_ids), wait_s=0.0,
                               service_s=0.0, chain=[], failovers=0, logprobs=[] if p.logprobs is not None else None)
                    for p in params]
        if self.planner is not None:
            for _ in params:
                self.planner.rates.arrive()
        t0 = time.monotonic()
        # A one-shot job never holds more than its prompt and its max_tokens: servers with a paged KV cache
        # reserve pages for that much, not for max_length.
        job_length = min(self.cfg.max_length, len(prompt_ids) + max(p.max_tokens for p in params))
        holders = [ChainHolder(self, f"r-{uuid.uuid4().hex[:12]}", job_length, relay=p.relay,
                               shape=(len(prompt_ids), p.max_tokens)) for p in params]
        holders[0].siblings = len(holders) - 1
        # one ticket per choice in the request's places (shared by its prompts, which the API submits apart): the
        # dispatcher admits the request's first job only with a place for each job still to come, and holds them.
        # Taken before any await, so a multi-prompt request's prompts all have theirs before its first job arrives
        tickets = places.expect(len(holders))
        for h in holders[1:]:
            h.fork_source = (holders[0], len(prompt_ids))
            h.checked = True
        prefill: asyncio.Future = asyncio.get_running_loop().create_future()
        # A failed prefill is reported by its own task; the siblings only wait on it.
        prefill.add_done_callback(lambda f: f.cancelled() or f.exception())
        results: list[Generation | None] = [None] * len(params)
        cached = 0  # the prefill's tokens that came from the servers' prefix caches

        async def one(i: int) -> None:
            nonlocal cached
            holder, p = holders[i], params[i]
            generated: list[int] = []
            ok = False
            scored_lp = None
            PLACE.set(tickets[i])  # this task's own context: its job's place
            try:
                if i == 0:
                    try:
                        out = await holder.feed(list(prompt_ids), all_positions=prompt_logprobs is not None)
                        cached = holder.reused_tokens
                        if prompt_logprobs is not None:
                            scored_lp = await self.batcher.score(out, list(prompt_ids), prompt_logprobs)
                            out = out[-1]
                            if scored is not None:
                                await scored(scored_lp)
                        prefill.set_result(out)
                    except BaseException as e:
                        if not prefill.done():
                            prefill.set_exception(e)
                        raise
                    hidden = out
                else:
                    hidden = await asyncio.shield(prefill)
                    holder.kv_ids = list(prompt_ids)  # fed lazily: forked on the sibling's chain or replayed
                    holder.paid = len(prompt_ids)  # the first choice's job paid the prompt
                    # its first token is charged where the prompt ran (where that job is counted now)
                    holder._worker, holder._worker_lease = holders[0]._worker, holders[0]._worker_lease
                generated, text, finish, choices = await self._decode_loop(holder, list(prompt_ids), hidden, p,
                                                                            emits[i], generated)
                ok = holder.completed = True
            finally:
                tickets[i].drop()  # done without a job of its own (nothing to generate) or failed before one
                self._background(holder.close())
                service = self._finish_job(holder, t0, len(generated), len(prompt_ids) if i == 0 else 0, ok)
            results[i] = Generation(token_ids=generated, text=text, finish_reason=finish, prompt_tokens=len(prompt_ids),
                                    wait_s=holder.wait_s, service_s=service, chain=holder.chain_names,
                                    failovers=holder.failovers, logprobs=choices if p.logprobs is not None else None,
                                    prompt_logprobs=scored_lp, forked=holder.forked, cached_tokens=cached)

        # before the first await: a request's prompts have all begun before any of them ends
        self.stats.begin_request_part(places)
        error: BaseException | None = None
        try:
            await gather_or_cancel(*(one(i) for i in range(len(params))))
            deadline = DEADLINE.get()
            if deadline is not None and settle:  # every choice is done: the request's last token has come
                self.deadlines.settle(deadline)
        except BaseException as e:
            error = e
            deadline = DEADLINE.get()
            if deadline is not None:  # failed or cancelled after admission: not met (a refusal is settled already)
                self.deadlines.settle(deadline, "missed")
            raise
        finally:
            if not prefill.done():
                prefill.cancel()
            for ticket in tickets:  # a choice that never queued (failed, cancelled) gives its place back
                ticket.drop()
            self.stats.end_request_part(places, error)
        for g in results[1:]:
            g.prompt_logprobs = results[0].prompt_logprobs
        return results  # type: ignore[return-value]
