"""Hub failures from the CLI: one line naming the endpoint, and a Hub that never answers times out."""

from __future__ import annotations

import socket
import time

import huggingface_hub
import pytest
from hub_server import SilentServer
from huggingface_hub.utils import _http

from quantmla_hf.cli.main import main
from quantmla_hf.tiny_models import tiny_mla_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    tiny_mla_model("deepseek_v3", seed=6).save_pretrained(path)
    return path


@pytest.fixture()
def endpoint(monkeypatch):
    """Point huggingface_hub at an endpoint for one test; the shared HTTP client is restored afterwards."""

    def use(url: str) -> str:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
        return url

    yield use
    huggingface_hub.set_client_factory(_http.default_client_factory)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _push(base_dir, tmp_path, capsys, *extra):
    start = time.monotonic()
    rc = main(["quantize", str(base_dir), "--out", str(tmp_path / "q"), "--transform", "none",
               "--push-to-hub", "tester/tiny", *extra])
    return rc, capsys.readouterr().err.strip(), time.monotonic() - start


def test_unreachable_hub_is_one_line_naming_the_endpoint(base_dir, tmp_path, capsys, endpoint):
    url = endpoint(f"http://127.0.0.1:{_closed_port()}")
    rc, err, _ = _push(base_dir, tmp_path, capsys)
    assert rc == 1
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error" in line]  # the rest is progress bars
    assert line.startswith("quantmla quantize: error: the Hub at") and url in line and "could not be reached" in line


def test_a_hub_that_never_answers_times_out(base_dir, tmp_path, capsys, endpoint):
    silent = SilentServer()
    try:
        url = endpoint(silent.endpoint)
        rc, err, seconds = _push(base_dir, tmp_path, capsys, "--hub-timeout", "1")
    finally:
        silent.close()
    assert rc == 1 and url in err and "did not answer in time" in err, err
    assert seconds < 60, f"took {seconds:.0f} s"
