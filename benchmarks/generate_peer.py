"""The peer the engine is measured against: transformers' own `generate` (its KV cache,
static batches) behind the same HTTP front as shardyard's app, a Ray Serve deployment on the same
proxy answering `POST /v1/completions` with the same OpenAI streaming chunks, so that the
benchmark's clients, proxy and wire format are the same for both and only the decoding differs.

A batch is what `@serve.batch` gathers (up to `max_batch_size` waiting requests): the prompts are
left-padded, `generate` runs once for the batch, greedy, and a streamer hands each step's tokens
to their requests as they come. A request that arrives while a batch runs waits for the next
batch: that is static batching, which the engine's continuous batching is meant to beat.
Benchmark only: not part of the platform.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray import serve

from shardyard.serve.http import openai_api as oa
from shardyard.serve.generation import TextCodec, left_pad

peer_api = FastAPI(title="generate-peer")
END = object()  # a request's last token was handed over


class FanOut:
    """transformers' streamer protocol (`put` once with the prompts, then once per step with each
    row's new token; `end`): each row's tokens go to its request's queue, on the server's loop."""

    def __init__(self, queues: list[asyncio.Queue], loop: asyncio.AbstractEventLoop) -> None:
        self.queues, self.loop, self.prompt_seen = queues, loop, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompts themselves
            self.prompt_seen = True
            return
        for queue, token in zip(self.queues, value.reshape(-1).tolist()):
            self.loop.call_soon_threadsafe(queue.put_nowait, token)

    def end(self) -> None:
        for queue in self.queues:
            self.loop.call_soon_threadsafe(queue.put_nowait, END)


@serve.deployment
@serve.ingress(peer_api)
class GeneratePeer:
    def __init__(self, model_dir: str, max_batch_size: int) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)  # the engine's shard computes on one thread too
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.codec = TextCodec()  # bytes, as the served directory has no tokenizer
        self._batch.set_max_batch_size(max_batch_size)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.01)
    async def _batch(self, asks: list[tuple[list[int], int]]) -> list[asyncio.Queue]:
        queues = [asyncio.Queue() for _ in asks]
        ids, pad = left_pad([prompt for prompt, _ in asks])
        mask = (torch.arange(ids.shape[1])[None, :] >= pad[:, None]).long()
        longest = max(n for _, n in asks)
        streamer = FanOut(queues, asyncio.get_running_loop())

        def run() -> None:
            try:
                with torch.no_grad():
                    # Every row runs to the batch's longest request (no end-of-sequence token here).
                    self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                                        min_new_tokens=longest, do_sample=False, pad_token_id=0,
                                        eos_token_id=None, streamer=streamer)
            except Exception:  # noqa: BLE001 - the batch's requests end (short) rather than hang
                streamer.end()
                raise

        asyncio.get_running_loop().run_in_executor(None, run)
        return queues

    async def _tokens(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        queue = await self._batch((prompt, max_tokens))
        for _ in range(max_tokens):
            token = await queue.get()
            if token is END:
                return
            yield token

    @peer_api.post("/v1/completions")
    async def completions(self, body: oa.CompletionRequest) -> StreamingResponse:
        """Greedy, streamed, one prompt: what the benchmark's clients send."""
        prompt, max_tokens = self.codec.encode(body.prompt[0]), body.max_tokens
        id_, model = oa.completion_id(False), "peer"

        async def events() -> AsyncIterator[str]:
            count = 0
            async for token in self._tokens(prompt, max_tokens):
                count += 1
                piece = self.codec.decode([token])
                chunk = oa.body(id_, model, model, [oa.choice(0, piece, None, False, delta=True)], False, chunk=True)
                yield f"data: {json.dumps(chunk)}\n\n"
            done = oa.body(id_, model, model, [oa.choice(0, "", "length", False, delta=True)], False, chunk=True)
            yield f"data: {json.dumps(done)}\n\n"
            usage = {**oa.body(id_, model, model, [], False, chunk=True), "usage": oa.usage(len(prompt), count)}
            yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def peer_app(model_dir: str, max_batch_size: int) -> serve.Application:
    """The peer on one replica of 1 CPU, as the engine's replica and shard hold 1.5 between them."""
    return GeneratePeer.options(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=4 * max_batch_size,
                                max_queued_requests=256).bind(model_dir, max_batch_size)

