"""``megamoe serve`` as users run it under torchrun, in a subprocess: two ranks with data-parallel attention over
EP 2 (12 expert slots for 8 experts), rank 0 prints where it listens (``--port 0``: a free port); two streamed
requests in flight at once run on the two data-parallel ranks (``/metrics`` shows one running on each), and the
``openai`` client gets the decode of ``generate()``'s greedy tokens for both; then rank 1 is killed, and the job
ends with an error instead of hanging. (TP 2 under torchrun follows rank 0's steps through the same
``Engine.follow``: tests/multirank/test_serving_layouts.py.)"""

import os
import re
import signal
import subprocess
import sys
import uuid

import pytest

from megamoe.inference.generation import GenerationConfig, generate
from parallel_state import ParallelState
from tests.helpers.serving import EOS_ID, save_served_checkpoint

openai = pytest.importorskip("openai", reason="the client tests need the openai package (test extra)")
httpx = pytest.importorskip("httpx", reason="the client tests need httpx (the openai package's HTTP client)")
pytest.importorskip("fastapi", reason="the server needs the serve extra (fastapi, uvicorn)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pid_of_rank(marker: str, rank: int) -> int | None:
    """The worker process whose environment holds ``marker`` and RANK=rank."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"MEGAMOE_SERVE_TEST") == marker.encode() and env.get(b"RANK") == str(rank).encode() \
                and env.get(b"LOCAL_RANK") is not None:
            return int(pid)
    return None


@pytest.mark.slow      # two ranks under torchrun: about 30 s of CPU
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds rank 1's process through /proc")
def test_megamoe_serve_under_torchrun_answers_then_ends_when_a_rank_dies(tmp_path):
    from megamoe.serving.http.tokenizer import ServingTokenizer
    model = save_served_checkpoint(str(tmp_path / "ckpt"))
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MEGAMOE_SERVE_TEST": marker, "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m", "megamoe",
         "serve", str(tmp_path / "ckpt"), "--ep", "2", "--data-parallel-attention", "--num-expert-slots", "12",
         "--port", "0", "--kv-cache-memory", "1MiB", "--block-size", "4", "--served-model-name", "tiny",
         "--comm-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = process.stdout.readline()
        match = re.search(r"serving tiny at (http://127\.0\.0\.1:\d+/v1) \(world 2, data-parallel attention over 2 "
                          r"ranks\)", line)
        assert match, line + (process.communicate(timeout=60)[1][-3000:] if not line else "")
        client = openai.OpenAI(base_url=match.group(1), api_key="none", max_retries=0, timeout=120)
        tokenizer = ServingTokenizer.from_path(tmp_path / "ckpt" / "hf_files")
        requests = {"x y z": 56, "the sky": 30}         # long enough to run at once (generate() meets no EOS)
        want = {prompt: generate(model, ParallelState.single_process(), [tokenizer.encode(prompt)],
                                 GenerationConfig(max_new_tokens=n, stop_token_ids=(EOS_ID,))).token_ids[0]
                for prompt, n in requests.items()}
        assert [len(want[prompt]) for prompt in requests] == list(requests.values())
        streams, texts = {}, {}
        for prompt, n in requests.items():      # the second arrives while the first runs: the other rank takes it
            streams[prompt] = iter(client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                             stream=True))
            texts[prompt] = next(streams[prompt]).choices[0].text
        # A second chunk comes a step later: /metrics (a snapshot after each step) shows the first's step by then.
        texts["the sky"] += next(streams["the sky"]).choices[0].text
        metrics = httpx.get(match.group(1)[:-len("/v1")] + "/metrics").text.splitlines()
        assert 'megamoe_dp_running{dp_rank="0"} 1' in metrics and 'megamoe_dp_running{dp_rank="1"} 1' in metrics, \
            [line for line in metrics if line.startswith("megamoe_dp_")]
        for prompt, stream in streams.items():
            texts[prompt] += "".join(chunk.choices[0].text for chunk in stream)
            assert texts[prompt] == tokenizer.decode(want[prompt]), prompt
        os.kill(_pid_of_rank(marker, 1), signal.SIGKILL)
        _, stderr = process.communicate(timeout=180)      # ends: never a hang
        assert process.returncode != 0, stderr[-3000:]
        assert stderr.strip().splitlines()[-1].startswith("megamoe serve: error: "), stderr[-3000:]
    finally:
        if process.poll() is None:       # the ranks first: they hold the pipes that communicate() reads to the end
            for pid in filter(None, (_pid_of_rank(marker, rank) for rank in (0, 1))):
                os.kill(pid, signal.SIGKILL)
            process.kill()
            process.communicate(timeout=60)
