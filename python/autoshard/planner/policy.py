"""The planner's policy (csrc/plan/policy.cpp), asked through the plan_policy op: the thresholds
and costs, and the decisions taken from them around a plan. Python measures the facts a decision
needs (what each rank holds, the predicted peaks) and the policy answers what to do and why."""

import json
from typing import Callable, Dict

import torch

from ..core import _library

_library.load()


def ask(question: dict) -> dict:
    """The policy's answer to one question (its format: csrc/plan/policy.cpp)."""
    return json.loads(torch.ops.autoshard.plan_policy(json.dumps(question)))


def decide(question: dict, measure: Dict[str, Callable[[dict], int]]) -> dict:
    """The policy's decision on `question`. Costly facts are measured only when the policy asks
    for them: an answer naming a "need" is asked again with measure[need](answer) added."""
    facts = dict(question)
    while True:
        answer = ask(facts)
        need = answer.get("need")
        if need is None:
            return answer
        if need in facts:
            raise RuntimeError(f"plan_policy asked again for {need!r}, already given: {answer}")
        facts[need] = measure[need](answer)
