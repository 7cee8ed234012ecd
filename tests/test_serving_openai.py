"""quantmla serve against the official `openai` client, under load and bad input.

The embedded reference model, quantized to C4R4 (RTN, float32 on the CPU), is served on 127.0.0.1 (ephemeral port)
with a cache of 40 pages of 16 tokens (a request holds 39 x 16 = 624 tokens, fewer than the model's context of 4096)
and 8 requests running at once. Greedy answers must be those of `generate` on the contiguous QuantMLA cache; every
bad request gets a 4xx JSON answer and the server keeps serving; 64 concurrent streams all complete (requests queue,
none is dropped); a client leaving mid-stream frees its pages (`GET /quantmla/cache`). Every wait is bounded.
"""

import asyncio
import importlib
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers.cli.serving.server")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from quantmla_hf import QuantMLAConfig, apply_quantmla  # noqa: E402
from quantmla_hf.embedded import REFERENCE_MODEL  # noqa: E402
from quantmla_hf.serving.server import CacheOptions, build_app  # noqa: E402

# From 5.25 the server checks prompts in its own process (`serving.loader`); up to 5.24 the batcher refuses them.
FROM_5_25 = hasattr(importlib.import_module("transformers.cli.serving.model_manager"), "ModelLoader")
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
OPTIONS = CacheOptions(num_pages=40, page_size=16, max_requests=8, max_batch_tokens=512)
LIMIT = 39 * 16  # tokens a request holds, prompt and answer
TIMEOUT = 120


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL, dtype=torch.float32)
    model = apply_quantmla(model, QuantMLAConfig(transform="none"))
    model.generation_config.do_sample = True  # each request chooses: temperature 0 is greedy
    model.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return str(path), model, tok


@pytest.fixture(scope="module")
def server(checkpoint):
    app, state = build_app(checkpoint[0], OPTIONS, device="cpu", dtype="float32")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:  # uvicorn sets no event on start
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start within 60 s"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    srv.should_exit = True
    thread.join(timeout=10)
    state.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def greedy(checkpoint, n: int, text: str | None = None, messages=None) -> list[int]:
    """`generate`'s greedy tokens (end token included) for a completion prompt or chat messages."""
    _, model, tok = checkpoint
    if messages is not None:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
    else:
        ids = tok(text, return_tensors="pt")["input_ids"]
    return model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()


def text_of(checkpoint, tokens) -> str:
    return checkpoint[2].decode(tokens, skip_special_tokens=True)


def cache_state(url) -> dict:
    r = httpx.get(f"{url}/quantmla/cache", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def wait_until_idle(url) -> dict:
    """The cache's state once no request runs or waits and every page is free but the graphs' scratch page."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        state = cache_state(url)
        if not state["requests_running"] and not state["requests_waiting"] and (
                state["free_pages"] == state["pages"] - state["graph_pages"]):
            return state
        assert time.monotonic() < deadline, f"the cache is still in use after {TIMEOUT} s: {state}"
        time.sleep(0.1)


def test_the_server_is_warm_and_empty_before_its_first_request(server):
    state = cache_state(server)
    assert state["format"] == "C4R4" and state["max_request_tokens"] == LIMIT
    assert state["warmup"]["batch_sizes"] == [1, 8] and state["warmup"]["steps"] > 0  # eager steps: 1 and 8
    assert state["free_pages"] == state["pages"] == 40 and not state["requests_running"]


def test_completions_and_chat_streamed_or_not_give_generate_greedy_text(client, checkpoint):
    model = checkpoint[0]
    prompt, messages = "The history of the city", [{"role": "user", "content": "Tell me about the river"}]
    want = text_of(checkpoint, greedy(checkpoint, 12, prompt))
    assert want.strip()
    done = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == want and done.usage.prompt_tokens == len(checkpoint[2](prompt)["input_ids"])
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    want = text_of(checkpoint, greedy(checkpoint, 12, messages=messages))
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want and chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_max_tokens_and_stop(client, checkpoint):
    model, tok = checkpoint[0], checkpoint[2]
    prompt = "The history of the city"
    tokens = greedy(checkpoint, 16, prompt)
    assert 0 not in tokens[:16], "the greedy answer ends early; pick a prompt that runs 16 tokens"
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    assert cut.choices[0].text == text_of(checkpoint, tokens[:5]) and cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 5
    # a stop string from the middle of the answer ends it with the token that completes it (as generate does)
    stop = tok.decode(tokens[6:8]).strip()
    end = next(j for j in range(1, 17) if stop in tok.decode(tokens[:j]))
    assert end < 16
    for stream in (False, True):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                        stream=stream)
        text = "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
        assert text == text_of(checkpoint, tokens[:end])
        if not stream:
            assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == end


def test_temperature_top_p_and_seed(client, checkpoint):
    model, prompt = checkpoint[0], "Once upon a time"
    want = text_of(checkpoint, greedy(checkpoint, 10, prompt))

    def complete(**kwargs):
        return client.completions.create(model=model, prompt=prompt, max_tokens=10, **kwargs).choices[0].text

    assert complete(temperature=0) == want
    assert complete(temperature=1.0, top_p=1e-9) == want  # only the likeliest token is left to sample
    hot = [complete(temperature=2.0, seed=s) for s in (1, 1, 2)]
    assert hot[0] == hot[1] != hot[2]  # a seed fixes the sample (requests one at a time)


def test_64_concurrent_streaming_clients_all_complete(server, checkpoint):
    """64 streams at once, 8 running at a time: the others wait in the queue, none is dropped, each gets the greedy
    text of its prompt, and the cache is empty afterwards."""
    model = checkpoint[0]
    topics = ["the sea", "a king", "the moon", "bread", "rain", "a horse", "old songs", "the war"]
    messages = [[{"role": "user", "content": f"Tell me about {t}"}] for t in topics]
    want = [text_of(checkpoint, greedy(checkpoint, 6, messages=m)) for m in messages]

    async def one(aclient, i):
        stream = await aclient.chat.completions.create(model=model, messages=messages[i % 8], max_tokens=6,
                                                       temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", timeout=TIMEOUT,
                                      max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    assert asyncio.run(run()) == [want[i % 8] for i in range(64)]
    assert wait_until_idle(server)["preemptions"] == 0


def test_a_client_leaving_mid_stream_frees_its_pages(server, checkpoint):
    before = cache_state(server)["cancelled"]
    body = {"model": checkpoint[0], "prompt": "The history of the city", "max_tokens": 500, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:  # tokens are coming: the request holds pages
                break
    state = wait_until_idle(server)  # the connection closed above
    assert state["cancelled"] == before + 1


def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(server, client, checkpoint):
    model, tok = checkpoint[0], checkpoint[2]
    post = lambda path, **kw: httpx.post(f"{server}/v1/{path}", timeout=TIMEOUT, **kw)  # noqa: E731

    r = post("chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"]  # malformed JSON
    for path, field in (("completions", "prompt"), ("chat/completions", "messages")):  # no prompt at all
        r = post(path, json={"model": model, "max_tokens": 4})
        assert r.status_code == 400 and f"no {field!r}" in r.json()["detail"]

    def refused(call, says: str) -> None:  # a 400 whose JSON body says why (transformers' {"detail": ...})
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert says in err.value.response.json()["detail"]

    refused(lambda: client.completions.create(model="no/such-model", prompt="Hello", max_tokens=4), "pinned to")
    refused(lambda: client.completions.create(model=model, prompt="", max_tokens=4), "empty")
    long_prompt = " the city" * 400
    assert len(tok(long_prompt)["input_ids"]) > LIMIT
    for stream in (False, True):  # refused before anything streams
        refused(lambda: client.completions.create(model=model, prompt=long_prompt, max_tokens=4, stream=stream),
                f"at most {LIMIT}")
        refused(lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_prompt}],
                                                       max_tokens=4, stream=stream), f"at most {LIMIT}")
    # an answer longer than the cache holds is cut there, not refused
    fits = " the city" * 290
    n = len(tok(fits)["input_ids"])
    out = client.completions.create(model=model, prompt=fits, max_tokens=4000, temperature=0)
    assert n + out.usage.completion_tokens <= LIMIT
    assert httpx.get(f"{server}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    assert client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0).choices[0].text == (
        text_of(checkpoint, greedy(checkpoint, 3, "Hello")))
    wait_until_idle(server)


@pytest.mark.skipif(not FROM_5_25, reason="transformers' server runs the model in a process of its own from 5.25")
def test_the_prompt_limit_is_the_cache_s_or_the_context_s():
    """The API process checks prompts against what the model's process will hold: the limit computed from the
    config alone equals the batcher's, for a cache of pages or of a budget, in the checkpoint's dtype or another."""
    from quantmla_hf.serving.batching import ContinuousBatcher
    from quantmla_hf.serving.loader import PagedGenerationState, PagedModelLoader
    from quantmla_hf.serving.manager import paged_cache_for

    model = apply_quantmla(AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL), QuantMLAConfig(transform="none"))
    assert model.dtype == torch.bfloat16  # the checkpoint's ("auto")
    for options, dtype in ((OPTIONS, "auto"), (CacheOptions(num_pages=1000), "auto"),
                           (CacheOptions(budget_gib=0.01, max_requests=4), "auto"),
                           (CacheOptions(budget_gib=0.01, max_requests=4), "float32")):
        state = PagedGenerationState(PagedModelLoader(options, device="cpu", dtype=dtype))
        served = model.to(getattr(torch, dtype) if dtype != "auto" else torch.bfloat16)
        batcher = ContinuousBatcher(served, paged_cache_for(served, options, announce=False), decode_graphs=False)
        assert state.context_length(model.config) == batcher.max_request_tokens
    assert PagedGenerationState(PagedModelLoader(CacheOptions(num_pages=1000))).context_length(model.config) == 4096
