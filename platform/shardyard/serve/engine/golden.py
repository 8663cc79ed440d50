"""Golden prompts: answers a followed run's new checkpoint must keep before it serves. Each prompt
is decoded greedily by the new weights (in the engine's drained window: no client's request is
decoded meanwhile) and compared with the answer it must give, or else with the served weights'
own answer; one farther than the allowed edit distance (in characters) refuses the checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardyard.serve.config import GoldenPrompt
from shardyard.serve.generation import Completion, SampledForward, TextCodec, decode_steps


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest characters inserted, deleted or replaced to make `b` of `a`."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def golden_requests(prompts: Sequence[GoldenPrompt], codec: TextCodec, stop_token: int | None) -> list[Completion]:
    """The prompts as greedy completions, for any decoder."""
    return [Completion(codec.encode(p.prompt), p.max_tokens, stop_token=stop_token) for p in prompts]


def answer_texts(requests: Sequence[Completion], codec: TextCodec) -> list[str]:
    """Each decoded request's answer as a client reads it (without the end-of-sequence token)."""
    return [codec.decode(r.tokens[:-1] if r.stopped else r.tokens) for r in requests]


def greedy_answers(forward: SampledForward, prompts: Sequence[GoldenPrompt], codec: TextCodec, block_size: int,
                   stop_token: int | None) -> list[str]:
    """Each prompt's greedy answer, decoded by the built-in decoder over `forward`."""
    requests = golden_requests(prompts, codec, stop_token)
    for _ in decode_steps(forward, requests, block_size):
        pass
    return answer_texts(requests, codec)


def regressions(prompts: Sequence[GoldenPrompt], served: Sequence[str], answers: Sequence[str],
                max_distance: int) -> list[str]:
    """Why `answers` (the new weights') fail: each prompt answered farther than `max_distance`
    from its `expect`, or from `served` (the served weights' answer) where it has none."""
    failed = []
    for prompt, before, after in zip(prompts, served, answers):
        wanted = before if prompt.expect is None else prompt.expect
        distance = edit_distance(wanted, after)
        if distance > max_distance:
            failed.append(f"the golden prompt {prompt.prompt!r} is answered {after!r}, {distance} edits from "
                          f"{wanted!r}")
    return failed
