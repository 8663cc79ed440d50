"""The sampling parameters OpenAI-compatible servers take (serve/sampling.py), each checked against
its definition on hand-made logits: what it does to the logits, which tokens it can draw, and the
log-probabilities reported. No Ray, no model."""

from __future__ import annotations

import math

import pytest
import torch

from shardyard.serve.generation import Completion
from shardyard.serve.sampling import Draw, Pick, Sampling, adjust, choose_rows, pick, sample_rows

pytestmark = pytest.mark.timeout(60)

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0, 0.0])  # likeliest first: 4, 0, 1, 2, 5, 3


def draws(sampling: Sampling, n: int = 400, logits: torch.Tensor = LOGITS) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {pick(logits, sampling, generator).token for _ in range(n)}


def test_top_k_and_min_p_and_top_p_keep_only_the_tokens_they_name() -> None:
    hot = Sampling(temperature=2.0)
    assert draws(hot) == set(range(6))  # hot enough that every token comes up
    assert draws(Sampling(temperature=2.0, top_k=2)) == {4, 0}
    assert draws(Sampling(temperature=2.0, top_k=1)) == {4}
    probs = torch.softmax(LOGITS / 2.0, -1)
    kept = {i for i in range(6) if probs[i] >= 0.3 * probs.max()}
    assert draws(Sampling(temperature=2.0, min_p=0.3)) == kept and len(kept) < 6
    order = probs.argsort(descending=True).tolist()
    nucleus = set(order[:next(i for i in range(6) if probs[order[:i + 1]].sum() >= 0.6) + 1])
    assert draws(Sampling(temperature=2.0, top_p=0.6)) == nucleus


def test_penalties_change_the_logits_as_defined() -> None:
    prompt, generated = [0, 1], [4, 4, 2]
    repeated = adjust(LOGITS, Sampling(repetition_penalty=2.0), prompt, generated, None)
    expected = LOGITS.clone()
    for t in {0, 1, 2, 4}:  # prompt and output: positive logits divided, negative ones multiplied
        expected[t] = expected[t] / 2 if expected[t] > 0 else expected[t] * 2
    torch.testing.assert_close(repeated, expected)
    negative = torch.tensor([-1.0, 1.0])
    torch.testing.assert_close(adjust(negative, Sampling(repetition_penalty=2.0), [0, 1], [], None),
                               torch.tensor([-2.0, 0.5]))
    penalized = adjust(LOGITS, Sampling(presence_penalty=0.5, frequency_penalty=0.25), prompt, generated, None)
    expected = LOGITS.clone()
    expected[4] -= 0.5 + 2 * 0.25  # output tokens only: 4 twice, 2 once; the prompt's are untouched
    expected[2] -= 0.5 + 0.25
    torch.testing.assert_close(penalized, expected)
    biased = adjust(LOGITS, Sampling(logit_bias=((3, 100.0),)), [], [], None)
    assert pick(biased).token == 3 and pick(LOGITS, Sampling(logit_bias=((3, 100.0),))).token == 3
    assert adjust(LOGITS, Sampling(), prompt, generated, 4) is LOGITS  # nothing asked: nothing copied


def test_a_repetition_penalty_steers_greedy_decoding_away_from_what_was_seen() -> None:
    assert pick(LOGITS).token == 4
    assert pick(LOGITS, Sampling(repetition_penalty=2.0), prompt=[4]).token == 0


def test_min_tokens_holds_the_end_of_sequence_back_and_ignore_eos_never_ends() -> None:
    eos = 4  # the likeliest token: greedy decoding would end at once
    logits = LOGITS.repeat(8, 1)
    held = Completion([1], 6, Sampling(min_tokens=3), stop_token=eos)
    for row in logits:
        if held.done:
            break
        held.advance(row)
    assert held.tokens == [0, 0, 0, eos] and held.stopped  # the end of sequence comes right after
    ignoring = Completion([1], 5, Sampling(ignore_eos=True), stop_token=eos)
    for row in logits:
        if ignoring.done:
            break
        ignoring.advance(row)
    assert ignoring.tokens == [eos] * 5 and not ignoring.stopped  # ran to max_tokens


def test_logprobs_are_the_raw_distributions_and_do_not_change_the_choice() -> None:
    sampling = Sampling(temperature=0.7, top_k=3, repetition_penalty=1.5, logprobs=3)
    a = pick(LOGITS, sampling, torch.Generator().manual_seed(1), prompt=[4])
    b = pick(LOGITS, Sampling(temperature=0.7, top_k=3, repetition_penalty=1.5), torch.Generator().manual_seed(1),
             prompt=[4])
    assert a.token == b.token and b.logprob is None
    raw = torch.log_softmax(LOGITS, -1)
    assert math.isclose(a.logprob, float(raw[a.token]), rel_tol=1e-6)
    assert [t for t, _ in a.top] == [4, 0, 1]
    assert all(math.isclose(lp, float(raw[t]), rel_tol=1e-6) for t, lp in a.top)
    assert pick(LOGITS, Sampling(logprobs=0)).top == ()


def test_a_seeded_draw_repeats_and_nan_logits_are_an_error() -> None:
    sampling = Sampling(temperature=1.0, top_k=4, min_p=0.05, top_p=0.9)
    first = [pick(LOGITS, sampling, g).token for g in [torch.Generator().manual_seed(7)] for _ in range(20)]
    again = [pick(LOGITS, sampling, g).token for g in [torch.Generator().manual_seed(7)] for _ in range(20)]
    assert first == again
    with pytest.raises(RuntimeError, match="NaN"):
        pick(torch.tensor([0.0, float("nan")]))


def test_a_draw_depends_on_its_seed_and_index_alone_so_it_can_be_made_anywhere_and_again() -> None:
    """What a shard gets to pick a token: the same draw picks the same token wherever and however
    often it is made; a request's tokens resumed from a copy (a rebuilt shard group) go on as they
    would have; the draw carries the history only where penalties or min_tokens read it."""
    sampling = Sampling(temperature=1.5)
    hot = torch.zeros(50)
    assert Draw(sampling, 7, 3).pick(hot) == Draw(sampling, 7, 3).pick(hot)
    by_index = [Draw(sampling, 7, i).pick(hot).token for i in range(40)]
    by_seed = [Draw(sampling, s, 0).pick(hot).token for s in range(40)]
    assert len(set(by_index)) > 10 and len(set(by_seed)) > 10  # each token its own stream, not one draw repeated

    request = Completion([1, 2, 3], 12, sampling, seed=11)
    whole = [request.advance(hot) for _ in range(12)]
    resumed = Completion([1, 2, 3], 12, sampling, seed=11)
    resumed.tokens = whole[:5]
    assert [resumed.advance(hot) for _ in range(7)] == whole[5:]

    plain = Completion([1, 2], 4, Sampling(temperature=0.5), seed=1, tokens=[9])
    assert plain.draw() == Draw(Sampling(temperature=0.5), 1, 1)  # nothing else travels
    penalized = Completion([1, 2], 4, Sampling(repetition_penalty=1.2, min_tokens=2), tokens=[9])
    assert (penalized.draw().prompt, penalized.draw().generated) == ((1, 2), (9,))


def test_rows_are_picked_together_and_a_nan_row_fails_alone() -> None:
    """choose_rows, what an executor runs over a pass's logits: plain greedy rows in one argmax,
    equal to each picked alone; a row with NaN logits gets its own error and the others their
    tokens; a row with no draw (a prompt chunk before its last) gets nothing."""
    logits = torch.randn(5, 30)
    logits[3, 4] = float("nan")
    draws = [Draw(Sampling()), Draw(Sampling(temperature=0.8), 3, 0), None, Draw(Sampling()),
             Draw(Sampling(logprobs=2))]
    out = choose_rows(logits, draws)
    assert out[0] == Pick(int(logits[0].argmax())) and out[1] == draws[1].pick(logits[1]) and out[2] is None
    assert isinstance(out[3], RuntimeError) and "NaN" in str(out[3])
    assert out[4] == pick(logits[4], Sampling(logprobs=2)) and len(out[4].top) == 2


def test_stop_strings_count_only_from_min_tokens_on() -> None:
    """vLLM's rule: before `min_tokens` a stop string is text like any other; from there on the
    first one ends the choice, the text cut before it."""
    from shardyard.serve.http.choices import ChoiceText
    from shardyard.serve.generation import TextCodec, encode

    def served(min_tokens: int) -> tuple[str, str]:
        request = Completion([1], 20, Sampling(min_tokens=min_tokens))
        choice = ChoiceText(request, TextCodec(), ["ab"], chat=False)
        for token in encode("xabyyabzz"):
            request.tokens.append(token)
            choice.push(token)
            if choice.stopped:
                break
        else:
            choice.finish()
        return choice.text(), choice.finish_reason

    assert served(0) == ("x", "stop")
    assert served(3) == ("x", "stop")  # the first "ab" ends with token 3: counted from there
    assert served(4) == ("xabyy", "stop")  # ...but not before
    assert served(9) == ("xabyyabzz", "length")


def test_rows_sampled_together_draw_each_token_with_its_probability_under_their_own_settings() -> None:
    """sample_rows, the batched choice: an unseeded hot row's tokens come up as often as its
    softmax says (within 3 standard errors over 20,000 draws); rows with other settings in the
    same batch keep only the tokens their own top-k, min-p and top-p name; a seeded row in a batch
    gets what it gets picked alone."""
    settings = [Sampling(temperature=2.0), Sampling(temperature=2.0, top_k=2), Sampling(temperature=2.0, min_p=0.3),
                Sampling(temperature=2.0, top_p=0.6), Sampling()]
    n = 20_000
    logits = LOGITS.repeat(n, 1)
    rows = [settings[i % len(settings)] for i in range(n)]
    ids = sample_rows(logits, rows, [None] * n)
    by_setting = [ids[i::len(settings)] for i in range(len(settings))]
    probs = torch.softmax(LOGITS / 2.0, -1)
    counts = torch.bincount(by_setting[0], minlength=6).float()
    expected = probs * len(by_setting[0])
    assert torch.all((counts - expected).abs() <= 3 * (expected * (1 - probs)).sqrt() + 1), (counts, expected)
    assert set(by_setting[1].tolist()) == {4, 0}
    assert set(by_setting[2].tolist()) == draws(Sampling(temperature=2.0, min_p=0.3))
    assert set(by_setting[3].tolist()) == draws(Sampling(temperature=2.0, top_p=0.6))
    assert set(by_setting[4].tolist()) == {4}  # greedy among them
    seeded = [Draw(Sampling(temperature=1.0, top_k=3), seed, 0) for seed in range(8)]
    logits = torch.randn(8, 30)
    together = choose_rows(logits, seeded)
    assert together == [draw.pick(logits[i]) for i, draw in enumerate(seeded)]
