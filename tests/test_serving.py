"""quantmla serve: transformers' OpenAI-compatible server on the paged QuantMLA cache, over loopback only.

A tiny QuantMLA checkpoint (random weights, the bundled reference tokenizer, nothing downloaded) is served on
127.0.0.1 with an ephemeral port; a chat completion, the same one streamed, and two concurrent ones must give the
greedy text of `generate` on the contiguous QuantMLA cache. Every wait is bounded.
"""

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers.cli.serving.server")

from transformers import AutoTokenizer  # noqa: E402

from quantmla_hf import QuantMLAConfig, apply_quantmla  # noqa: E402
from quantmla_hf.serving.manager import PagedBatchingManager  # noqa: E402
from quantmla_hf.serving.server import CacheOptions, build_app, quantmla_config_of  # noqa: E402
from quantmla_hf.tiny_models import tiny_mla_model  # noqa: E402

TOKENIZER = Path(__file__).resolve().parent.parent / "quantmla_hf" / "assets" / "reference_model"
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    model = apply_quantmla(
        tiny_mla_model("deepseek_v3", seed=5, vocab_size=8192),
        QuantMLAConfig(content_bits=4, rope_bits=4, group_size=16, sink_tokens=2, recent_tokens=8, transform="none",
                       advanced={"kernel": "torch"}),
    )
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path, model, tok


@pytest.fixture(scope="module")
def server(checkpoint):
    path = checkpoint[0]
    app, state = build_app(str(path), CacheOptions(num_pages=64, page_size=8, max_requests=4, max_batch_tokens=256),
                           device="cpu", dtype="float32")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start within 60 s"
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", str(path), state
    srv.should_exit = True
    thread.join(timeout=10)
    state.shutdown()


def expected(checkpoint, content):
    _, model, tok = checkpoint
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def chat(url, model, content, stream=False):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    return text


def test_chat_completion_and_streaming_use_the_packed_cache(server, checkpoint):
    url, model, state = server
    want = expected(checkpoint, "Hello there")
    assert want.strip()
    assert chat(url, model, "Hello there") == want
    assert chat(url, model, "Hello there", stream=True) == want
    if hasattr(state, "managers"):  # transformers <= 5.24: the batcher runs in this process
        manager = next(iter(state.managers.values()))
        assert manager.cache.format.name == "C4R4"  # the paged packed cache served it, not an ordinary one
        assert manager.thread.batcher.stats.generated_tokens >= 2 * MAX_TOKENS
    else:  # from 5.25 in the model's process, whose loader gives the model the paged batching manager
        from quantmla_hf.serving.loader import PagedModelLoader

        assert isinstance(state.loader, PagedModelLoader)
        assert [e.process_running and not e.is_dead for e in state.engines.values()] == [True]


def test_the_batching_manager_streams_each_request_on_the_packed_cache(checkpoint):
    """The manager transformers' runner drives from 5.25 (`add_request`, `get_result`, `cancel_request`), in this
    process: each output carries the request's tokens so far, the last one all of them, greedy as `generate` on the
    contiguous packed cache; a cancelled request ends without output; the batcher ran on the paged C4R4 cache."""
    _, model, tok = checkpoint
    prompts = {rid: tok(text, return_tensors="pt")["input_ids"]
               for rid, text in (("a", "Hello there"), ("b", "a somewhat longer message to the model"))}
    want = {rid: model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)[
        0, ids.shape[1]:].tolist() for rid, ids in prompts.items()}  # before the batcher takes the model
    manager = PagedBatchingManager(model, CacheOptions(num_pages=32, page_size=8, max_requests=2, max_batch_tokens=64))
    manager.warmup()
    manager.start()
    try:
        for rid, ids in prompts.items():
            manager.add_request(ids, request_id=rid, streaming=True, max_new_tokens=MAX_TOKENS, top_k=1)
        manager.add_request([5, 6, 7], request_id="gone", max_new_tokens=1000, top_k=1)
        manager.cancel_request("gone")
        seen, final = {rid: [] for rid in prompts}, {}
        deadline = time.time() + 120
        while len(final) < len(prompts):
            assert time.time() < deadline, "the batcher did not finish within 120 s"
            out = manager.get_result(timeout=1)
            if out is None or out.request_id == "gone":
                continue
            assert out.error is None and out.generated_tokens[:len(seen[out.request_id])] == seen[out.request_id]
            seen[out.request_id] = out.generated_tokens
            if out.is_finished():
                final[out.request_id] = out.generated_tokens
        assert final == want
        assert manager.cache.format.name == "C4R4" and manager.background_thread_status.fatal_error is None
        assert manager.batcher.stats.generated_tokens >= 2 * MAX_TOKENS
    finally:
        manager.stop()


def test_concurrent_requests_are_batched(server, checkpoint):
    url, model, state = server
    prompts = ["a short one", "a somewhat longer message to the model", "third"]
    results = [None] * len(prompts)

    def run(i):
        results[i] = chat(url, model, prompts[i], stream=bool(i % 2))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [expected(checkpoint, p) for p in prompts]


def test_a_model_without_quantmla_is_refused():
    with pytest.raises(ValueError, match="not a QuantMLA checkpoint"):
        quantmla_config_of(tiny_mla_model("deepseek_v3"))
