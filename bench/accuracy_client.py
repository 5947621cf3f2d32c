"""bench.accuracy's requests: the token-level plan of each session (priming request, teacher-forced
questions) and the /generate calls that score one configuration's server on them."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from bench.accuracy_stats import kl_topk
from bench.workloads import Session


@dataclass(frozen=True)
class Question:
    session: int
    turn: int
    task: str
    input_ids: list[int]  # history + question + reference answer + <|im_end|>
    answer_start: int  # index of the first answer token in input_ids
    targets: list[int]  # reference answer tokens and <|im_end|>


@dataclass(frozen=True)
class SessionPlan:
    prime_ids: list[int]  # system + user turn 1 up to the end of the context
    questions: list[Question]


def _encode(tok: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tok.encode(text, add_special_tokens=False)


def plan_session(tok: Any, session: Session) -> SessionPlan:
    """Token ids of the priming request and of every teacher-forced question (reference answers
    as the history, so every configuration sees the same prompts)."""
    gold = [t.answer or "" for t in session.turns]
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    questions = []
    for k in range(len(session.turns)):
        msgs = session.messages(k, gold)
        prompt = _encode(tok, msgs, True)
        full = _encode(tok, [*msgs, {"role": "assistant", "content": gold[k]}], False)
        if full[:len(prompt)] != prompt or end_id not in full[len(prompt):]:
            raise ValueError(f"session {session.id} turn {k}: the answer does not extend the prompt")
        stop = full.index(end_id, len(prompt)) + 1
        questions.append(Question(session.id, k, session.task, full, len(prompt),
                                  full[len(prompt):stop]))
    first = _encode(tok, session.messages(0, gold), True)
    text = tok.apply_chat_template(session.messages(0, gold), tokenize=False,
                                   add_generation_prompt=True)
    head = tok.encode(text[:text.index(session.context) + len(session.context)],
                      add_special_tokens=False)
    common = next((i for i, (a, b) in enumerate(zip(head, first, strict=False)) if a != b),
                  min(len(head), len(first)))
    return SessionPlan(first[:common], questions)


# ---- requests --------------------------------------------------------------------------------


def post(base_url: str, body: dict[str, Any], timeout: float = 1800.0) -> dict[str, Any]:
    req = urllib.request.Request(base_url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def prime(base_url: str, plan: SessionPlan) -> None:
    """Prefill the context alone; when the request finishes its pages are sealed and cached."""
    post(base_url, {"input_ids": plan.prime_ids,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}})


def score_question(base_url: str, q: Question, top_k: int, ref: dict[str, Any] | None) -> dict[str, Any]:
    """One teacher-forced request. Entry j of input_*_logprobs is the distribution over token
    logprob_start_len + j, so starting one before the answer, entries 1..m cover the targets."""
    body: dict[str, Any] = {
        "input_ids": q.input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True, "logprob_start_len": q.answer_start - 1, "top_logprobs_num": top_k}
    if ref is not None:
        body["token_ids_logprob"] = sorted({t for pos in ref["ref_top"] for t, _ in pos})
    meta = post(base_url, body)["meta_info"]
    m = len(q.targets)
    tops = [[(int(t), float(lp)) for lp, t, _ in meta["input_top_logprobs"][j]] for j in range(1, m + 1)]
    record = {"session": q.session, "turn": q.turn, "task": q.task, "answer_tokens": m,
              "cached_tokens": int(meta.get("cached_tokens", 0)),
              "top1": [max(top, key=lambda x: x[1])[0] == t for top, t in zip(tops, q.targets, strict=True)]}
    record["exact"] = all(record["top1"])
    if ref is None:  # the reference run keeps its top-K for the others
        record["ref_top"] = [[[t, lp] for t, lp in top] for top in tops]
        record["kl_tokens"] = [0.0] * m
    else:
        cfg = [{int(t): float(lp) for lp, t, _ in meta["input_token_ids_logprobs"][j]}
               for j in range(1, m + 1)]
        record["kl_tokens"] = [kl_topk([lp for _, lp in pos], [c[t] for t, _ in pos])
                               for pos, c in zip(ref["ref_top"], cfg, strict=True)]
    record["kl"] = sum(record["kl_tokens"]) / m
    return record


def evaluate(base_url: str, plans: list[SessionPlan], top_k: int,
             ref: dict[tuple[int, int], dict[str, Any]] | None, label: str) -> list[dict[str, Any]]:
    """Prime and score every session in order, printing progress."""
    records, t0 = [], time.monotonic()
    for i, plan in enumerate(plans, start=1):
        prime(base_url, plan)
        for q in plan.questions:
            records.append(score_question(base_url, q, top_k, None if ref is None else ref[q.session, q.turn]))
        done = records[-len(plan.questions):]
        print(f"    {label}: session {i}/{len(plans)} ({plan.questions[0].task}) "
              f"exact {sum(r['exact'] for r in done)}/{len(done)}, "
              f"KL {sum(r['kl'] for r in done) / len(done):.4f}, {time.monotonic() - t0:.0f} s",
              flush=True)
    return records
