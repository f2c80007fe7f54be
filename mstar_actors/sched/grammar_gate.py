"""Constrained requests held until every rank has compiled their grammar.

A grammar's compile (its token masks over the vocabulary) takes from
milliseconds to seconds; done where a request starts, in a rank's step loop,
it held every row of the batch that long. So the conductor sends
``CompileGrammar`` when a constrained request arrives, each rank compiles it
on a thread beside its steps, and the request goes on to the adapter pool
and the scheduler only once every rank answered ``GrammarCompiled``; its
start then finds the grammar compiled. One rank's refusal fails the request
(a 400 naming the field). Pure: no I/O.
"""

from __future__ import annotations

from mstar_actors.messages import CompileGrammar, Failed, Finished, GrammarCompiled, Prepared, choice_ids


class GrammarGate:
    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self._held: dict[str, tuple[Prepared, set[int]]] = {}  # request id -> (request, ranks that answered)

    @property
    def num_waiting(self) -> int:
        """Choices held (the gauges count choices)."""
        return sum(prepared.n for prepared, _ in self._held.values())

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def hold(self, prepared: Prepared) -> CompileGrammar:
        """Hold a constrained request; what to send every rank."""
        if prepared.request_id in self._held:
            raise ValueError(f"request {prepared.request_id!r} is already waiting for its grammar")
        self._held[prepared.request_id] = (prepared, set())
        return CompileGrammar(prepared.request_id, prepared.sampling.structured)

    def on_compiled(self, msg: GrammarCompiled) -> Prepared | Failed | None:
        """A rank's answer: the request once every rank compiled it, its
        ``Failed`` at the first refusal, else None (more to come, or the
        request ended meanwhile)."""
        held = self._held.get(msg.request_id)
        if held is None:
            return None  # aborted or failed already: a late answer
        prepared, answered = held
        if not msg.ok:
            del self._held[msg.request_id]
            param = prepared.sampling.structured.param or "structured_outputs"
            if msg.busy:
                return Failed(request_id=msg.request_id, status=503, error_type="service_unavailable_error",
                              code="grammar_compiler_busy", message=msg.error)
            return Failed(request_id=msg.request_id, status=400, param=param, message=f"{param}: {msg.error}")
        answered.add(msg.rank)
        if len(answered) < self.num_ranks:
            return None
        del self._held[msg.request_id]
        return prepared

    def drop(self, request_id: str) -> list[Finished]:
        """An abort of a held request: each of its choices ends."""
        held = self._held.pop(request_id, None)
        if held is None:
            return []
        prepared, _ = held
        return [Finished(request_id=rid, finish_reason="abort", num_prompt_tokens=len(prepared.prompt_token_ids),
                         num_output_tokens=0) for rid in choice_ids(request_id, prepared.n)]
