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
from quantmla_hf.paged.serving import CacheOptions, build_app, quantmla_config_of  # noqa: E402
from quantmla_hf.tiny_models import tiny_mla_model  # noqa: E402

TOKENIZER = Path(__file__).resolve().parent.parent / "quantmla_hf" / "assets" / "reference_model"
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    model = apply_quantmla(
        tiny_mla_model("deepseek_v3", seed=5, vocab_size=8192),
        QuantMLAConfig(content_bits=4, rope_bits=4, group_size=16, sink_tokens=2, recent_tokens=8, kernel="torch",
                       transform="none"),
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
    manager = next(iter(state.managers.values()))
    assert manager.cache.format.name == "C4R4"  # the paged packed cache served it, not an ordinary one
    assert manager.thread.batcher.stats.generated_tokens >= 2 * MAX_TOKENS


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
