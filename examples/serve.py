"""Serve a QuantMLA checkpoint over HTTP (OpenAI chat completions, streaming included) with continuous batching on
the paged packed cache, then talk to it: what `quantmla serve DIR` runs, started here in-process on loopback.

Real model: MODEL=deepseek-ai/DeepSeek-V2-Lite-Chat python examples/serve.py
(runs offline on a tiny random model with the reference tokenizer when MODEL is unset; the text is then random).
From a shell the same server is: quantmla serve DIR --cache-gib 16 --port 8000
(From transformers 5.25 on, the server loads the model in a process of its own, started the "spawn" way, which
imports this file again: hence the `__main__` guard.)
"""

import json
import tempfile
import threading
import time

import httpx
import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantmla_hf
from _tiny import model_id as offline_or_env
from quantmla_hf.serving.server import CacheOptions, build_app


def main():
    # 1. A QuantMLA checkpoint: quantize (RTN, no calibration data) and save, as `quantmla quantize` does.
    source = offline_or_env()
    checkpoint = tempfile.mkdtemp(prefix="quantmla-served-")
    model = AutoModelForCausalLM.from_pretrained(
        source, quantization_config=quantmla_hf.QuantMLAConfig(transform="none"), dtype=torch.float32
    )
    model.save_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.chat_template is None:  # the offline tokenizer has none
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(checkpoint)
    del model

    # 2. The server: transformers' app, every request through the paged C4R4 cache (here 64 pages of 64 tokens).
    app, state = build_app(checkpoint, CacheOptions(num_pages=64, page_size=64, max_requests=8), device="cpu")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/chat/completions"

    # 3. A chat completion, then the same request streamed (server-sent events).
    body = {"model": checkpoint, "messages": [{"role": "user", "content": "Tell me about the city."}], "max_tokens": 16}
    reply = httpx.post(url, json=body, timeout=300).json()
    print("completion:", repr(reply["choices"][0]["message"]["content"]))
    streamed = ""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    print("streamed:  ", repr(streamed))
    # The server's log names the cache it built at start ("QuantMLA paged cache: C4R4, 64 pages x 64 tokens ...").

    server.should_exit = True
    thread.join(timeout=10)
    state.shutdown()


if __name__ == "__main__":
    main()
