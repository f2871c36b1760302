"""``megamoe serve`` as users run it, in a subprocess: it prints where it listens (``--port 0``: a free port),
answers the ``openai`` client (a completion equal to the decode of ``generate()``'s greedy tokens, and a chat),
and stops on SIGTERM with exit code 0."""

import os
import re
import signal
import subprocess
import sys

import pytest

from megamoe.inference.generation import GenerationConfig, generate
from parallel_state import ParallelState
from tests.helpers.serving import EOS_ID, save_served_checkpoint

openai = pytest.importorskip("openai", reason="the client tests need the openai package (test extra)")
pytest.importorskip("fastapi", reason="the server needs the serve extra (fastapi, uvicorn)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_megamoe_serve_answers_the_openai_client_and_stops_on_sigterm(tmp_path):
    from megamoe.serving.http.tokenizer import ServingTokenizer
    model = save_served_checkpoint(str(tmp_path / "ckpt"))
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    process = subprocess.Popen([sys.executable, "-m", "megamoe", "serve", str(tmp_path / "ckpt"), "--port", "0",
                                "--kv-cache-memory", "1MiB", "--block-size", "4", "--served-model-name", "tiny"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = process.stdout.readline()
        match = re.search(r"serving tiny at (http://127\.0\.0\.1:\d+/v1)", line)
        assert match, line + process.stderr.read() if process.poll() is not None else line
        client = openai.OpenAI(base_url=match.group(1), api_key="none", max_retries=0, timeout=120)
        tokenizer = ServingTokenizer.from_path(tmp_path / "ckpt" / "hf_files")
        prompt = "x y z"
        want = generate(model, ParallelState.single_process(), [tokenizer.encode(prompt)],
                        GenerationConfig(max_new_tokens=8, stop_token_ids=(EOS_ID,))).token_ids[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == tokenizer.decode(want)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr[-3000:]
        assert "Traceback" not in stderr and "stopped serving" in stderr, stderr[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
