"""A request as the engine runs it: one typed Plan, made once, read by everyone after.

    plan = planner.plan(prompt_ids, Sampling(max_tokens=64, temperature=0.7, seed=1), grammar=None)

The planner checks the request against the model's context and the memory the server was given
(`KVBudget`): a request whose KV can never fit is refused (`Refused`, HTTP 400) with the numbers;
one that fits the budget but not the pages free now waits in the engine's queue.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


class Refused(Exception):
    """A request the server will never run (HTTP `status`, OpenAI error `code`)."""

    def __init__(self, message: str, status: int = 400, code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple = ()


@dataclass(frozen=True)
class Plan:
    prompt: List[int]
    sampling: Sampling
    kv_positions: int            # prompt + max_tokens: what the KV reservation covers
    kv_bytes: int                # its forecast bytes (the pool's pages, or the runner's window)
    grammar: Optional[str] = None   # an llguidance grammar (JSON), enforced on every token
    eos: tuple = ()
    thermal: bool = False        # its decode steps read the sketch's choice of its prompt (zeroedge.serve.thermal)
    notes: tuple = field(default=())
    # a sequential backend's: the session's plan of the decoder and its mechanisms (RunPlan)
    session_plan: Optional[object] = None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Planner:
    """ctx: the longest prompt + completion the model takes; positions_total / position_bytes: the
    KV the server holds for all requests together (its pool) and one position's bytes."""

    def __init__(self, ctx: int, positions_total: int, position_bytes: int, eos=(), where: str = "the KV pool",
                 min_prompt: int = 1, thermal_gate=None, session=None):
        """thermal_gate: zeroedge.kv.policy.ReleaseGate deciding which requests take thermal KV (None: off);
        session: the ServingSession behind a sequential backend, whose plan each request also gets."""
        self.ctx, self.positions_total, self.position_bytes = ctx, positions_total, position_bytes
        self.eos, self.where, self.min_prompt = tuple(eos), where, min_prompt
        self.thermal_gate, self.session = thermal_gate, session

    def plan(self, prompt: List[int], sampling: Sampling, grammar: Optional[str] = None,
             ignore_eos: bool = False) -> Plan:
        n = len(prompt)
        if n == 0:
            raise Refused("the prompt is empty")
        if n < self.min_prompt:
            raise Refused(f"this server's model (a bundle) needs a prompt of at least {self.min_prompt} tokens")
        if n + sampling.max_tokens > self.ctx:
            raise Refused(f"{n} prompt tokens + max_tokens {sampling.max_tokens} exceed the model's context "
                          f"of {self.ctx} tokens", code="context_length_exceeded")
        need = n + sampling.max_tokens
        if need > self.positions_total:
            raise Refused(f"{n} prompt tokens + max_tokens {sampling.max_tokens} need "
                          f"{_mib(need * self.position_bytes)} of KV; {self.where} holds "
                          f"{_mib(self.positions_total * self.position_bytes)} in all",
                          code="insufficient_memory")
        if ignore_eos and grammar is not None:
            raise Refused("ignore_eos cannot go with response_format (the grammar ends with EOS)",
                          param="ignore_eos")
        thermal = self.thermal_gate is not None and self.thermal_gate.allows(need, sampling.temperature)
        session_plan = None
        if self.session is not None:
            from zeroedge.errors import UserError

            try:
                session_plan = self.session.plan(n, sampling.max_tokens, sampling.temperature)
            except UserError as e:
                raise Refused(str(e)) from None
        return Plan(list(prompt), sampling, need, need * self.position_bytes, grammar,
                    () if ignore_eos else self.eos, thermal, session_plan=session_plan)
