"""Every script in examples/ runs offline on a tiny model (push_to_hub against the loopback Hub).

All examples run in one child process (one import of torch/transformers), started with HF_ENDPOINT pointing at
the test server; this file run as a script is that child.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

from hub_server import HubServer
from test_hub import hub_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = ["quantize_and_generate.py", "pipeline.py", "save_and_reload.py", "push_to_hub.py", "calibrate_on_text_file.py",
           "serve.py"]


def test_examples_run(tmp_path):
    assert sorted(SCRIPTS) == sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
    server = HubServer().start()
    try:
        env = hub_env(server.endpoint, tmp_path / "hf_home")
        env.pop("MODEL", None)
        report = tmp_path / "report.json"
        proc = subprocess.run([sys.executable, __file__, str(report)], env=env, capture_output=True, text=True,
                              timeout=900, cwd=tmp_path)
        assert report.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
        failures = {k: v for k, v in json.loads(report.read_text()).items() if v != "ok"}
        assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
        files = server.state.repos[("model", "tester/quantmla-example")].commits[-1][1]
        assert {"README.md", "model.safetensors", "tokenizer.json"} <= set(files)
        assert "identical logits True" in proc.stdout and "calibrated=True" in proc.stdout
    finally:
        server.stop()


def run_all(report: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    results = {}
    for name in SCRIPTS:
        try:
            runpy.run_path(str(EXAMPLES / name), run_name="__main__")
            results[name] = "ok"
        except BaseException:  # an example that exits or raises is a failure to report, not to hide
            results[name] = traceback.format_exc()
    report.write_text(json.dumps(results))


if __name__ == "__main__":
    run_all(Path(sys.argv[1]))
