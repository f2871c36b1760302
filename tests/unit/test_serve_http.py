"""The OpenAI-compatible server (megamoe.serving.http) over the real engine, in process: uvicorn in a thread on a
free port, the real ``openai`` client (and raw HTTP for what the client cannot send).

- completions and chats, streamed and not: each text is the tokenizer's decode of ``generate()``'s greedy tokens
  (special tokens skipped), a stream's deltas concatenate to it, usage and finish reasons in OpenAI's shapes;
- incremental detokenization never shows half a UTF-8 character; stop strings end the text before them;
- ``/v1/models``, ``/health``, ``/metrics`` (Prometheus text, counts that match the requests served);
- bad input: each a 4xx with OpenAI's JSON error naming the problem, and the server keeps serving;
- faults, with the test double ``PacedEngine`` (the real engine, stepped only when the test says): a client
  that disconnects mid-stream has its request aborted and its blocks freed, a flood is answered 429, an engine
  that fails (a dead rank) ends the server with its error.
"""

import json
import math
import re
import threading

import httpx
import pytest

from megamoe.inference.generation import GenerationConfig, generate
from megamoe.inference.sampling import SamplingConfig
from megamoe.serving import Engine, EngineConfig
from megamoe.serving.http.detokenizer import IncrementalDetokenizer
from megamoe.serving.http.tokenizer import ServingTokenizer
from tests.helpers.inference import SOLO, _our_model
from tests.helpers.serving import (EOS_ID, PacedEngine, running_server, save_chat_tokenizer,
                                   save_served_checkpoint)

pytest.importorskip("fastapi", reason="the server needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the client tests need the openai package (test extra)")

CONFIG = EngineConfig(kv_cache_memory=1 << 20, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
PROMPT = "x y z"                 # its greedy continuation: "???rH2,,,,,."
CHAT = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is 2 + 2?"}]
NEW = 12


@pytest.fixture(scope="module")
def model():
    return _our_model("qwen3_moe")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    save_chat_tokenizer(directory)
    return ServingTokenizer.from_path(directory)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    with running_server(Engine(model, SOLO, CONFIG, tokenizer=tokenizer), tokenizer) as (server, errors):
        yield server
    assert not errors


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


def _greedy_text(model, tokenizer, prompt_ids, new=NEW):
    out = generate(model, SOLO, [prompt_ids], GenerationConfig(max_new_tokens=new, stop_token_ids=(EOS_ID,)))
    return out.token_ids[0], tokenizer.decode(out.token_ids[0]), out.finish_reasons[0]


def _until(condition, polls=1200):
    """Wait until ``condition()`` holds (polled every 50 ms; an AssertionError after ``polls`` polls)."""
    for _ in range(polls):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError("the condition never held")


def _metrics(server) -> dict:
    """The Prometheus text as {sample name with labels: value}."""
    text = httpx.get(server.url + "/metrics").text
    return {name: float(value) for name, value in re.findall(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


# --- completions and chats -------------------------------------------------------------------------------------

def test_completions_streamed_and_not_equal_the_decode_of_generate(client, model, tokenizer):
    ids, text, reason = _greedy_text(model, tokenizer, tokenizer.encode(PROMPT))
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert got.choices[0].text == text and got.choices[0].finish_reason == reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(tokenizer.encode(PROMPT)), len(ids))
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == len(ids)
    by_ids = client.completions.create(model="tiny", prompt=tokenizer.encode(PROMPT), max_tokens=NEW, temperature=0)
    assert by_ids.choices[0].text == text


def test_chat_streamed_and_not_equal_the_decode_of_generate_over_the_chat_template(client, model, tokenizer):
    import transformers
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer.path))     # the oracle renders the chat
    prompt_ids = hf.encode(hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    ids, text, reason = _greedy_text(model, tokenizer, prompt_ids)
    got = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=NEW, temperature=0, logprobs=True)
    choice = got.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, reason)
    assert got.usage.prompt_tokens == len(prompt_ids) and got.usage.completion_tokens == len(ids)
    assert [t.token for t in choice.logprobs.content] == [tokenizer.token_text(t) for t in ids]
    assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=NEW, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_seeded_samples_streamed_and_not_equal_generate_with_the_seed_and_request_id(client, model, tokenizer):
    """A sampled text is varied (spaces, bytes of split characters, special tokens): streamed, it still
    concatenates to the decode of the tokens generate() samples with that seed and request id."""
    prompt_ids = tokenizer.encode(PROMPT)
    sampling = SamplingConfig(temperature=1.0, top_k=40, seed=7)
    for stream in (False, True):
        kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, extra_body={"top_k": 40})
        if stream:
            chunks = list(client.completions.create(**kwargs, stream=True))
            response_id, text = chunks[0].id, "".join(c.choices[0].text for c in chunks)
        else:
            got = client.completions.create(**kwargs)
            response_id, text = got.id, got.choices[0].text
        request_id = int(response_id.removeprefix("cmpl-"))
        want = generate(model, SOLO, [prompt_ids], GenerationConfig(max_new_tokens=24, stop_token_ids=(EOS_ID,),
                                                                   sampling=sampling), request_ids=[request_id])
        assert text == tokenizer.decode(want.token_ids[0])


def test_a_stop_string_ends_the_text_before_it(client, model, tokenizer):
    _, full, _ = _greedy_text(model, tokenizer, tokenizer.encode(PROMPT))
    stop = full[4:6]
    want = full[:full.index(stop)]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stop=[stop, "zz"])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "stop")
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_incremental_detokenization_never_shows_half_a_character(tokenizer):
    ids = tokenizer.encode("a € b")                      # the euro sign is three byte tokens
    detokenizer = IncrementalDetokenizer(tokenizer.decode)
    deltas = [detokenizer.add([t]) for t in ids] + [detokenizer.finish()]
    assert "".join(deltas) == tokenizer.decode(ids) == "a € b"
    assert all("\ufffd" not in d for d in deltas) and " €" in deltas
    stopped = IncrementalDetokenizer(tokenizer.decode, stop=["€ b"])
    deltas = [stopped.add([t]) for t in ids] + [stopped.finish()]
    assert "".join(deltas) == "a " and stopped.stopped


# --- models, health, metrics -------------------------------------------------------------------------------------

def test_models_health_and_metrics(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    before = _metrics(served)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    after = _metrics(served)
    assert after["megamoe_generation_tokens_total"] - before["megamoe_generation_tokens_total"] == \
        got.usage.completion_tokens
    assert after["megamoe_time_to_first_token_seconds_count"] == before["megamoe_time_to_first_token_seconds_count"] + 1
    for name in ("megamoe_running", "megamoe_waiting", "megamoe_kv_blocks_used", "megamoe_kv_blocks_total",
                 "megamoe_prefix_cache_hit_rate", "megamoe_generation_tokens_per_second",
                 'megamoe_time_per_output_token_seconds_bucket{le="+Inf"}'):
        assert name in after, name
    assert after["megamoe_running"] == after["megamoe_waiting"] == 0
    assert after["megamoe_prefix_cache_hits_total"] > 0        # the same prompt again: its full blocks are shared
    assert any(name.startswith('megamoe_expert_balancedness{layer=') for name in after)


# --- the README's and docs' examples, run against the server ----------------------------------------------

def _documented(pages=("README.md", "docs/serving.md")):
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    return {page: (root / page).read_text() for page in pages}


def test_the_readme_serving_examples_run_against_a_server(served, capsys):
    """The README.md "## Serving" python block as written (its URL and model name pointed at this server), and
    every documented curl request."""
    import shlex
    from megamoe.serving.http.app import ENDPOINTS
    pages = _documented()
    assert {route.path for route in served.app.routes} >= set(ENDPOINTS)
    readme = pages["README.md"]
    block = re.search(r"^## Serving\n.*?```python\n(.*?)^```", readme, re.S | re.M).group(1)
    exec(block.replace("http://127.0.0.1:8000", served.url).replace('"ckpt"', '"tiny"'), {})
    assert "CompletionUsage(" in capsys.readouterr().out
    curls = [shlex.split(line) for text in pages.values() for line in text.splitlines() if line.startswith("curl ")]
    assert len(curls) >= 4
    for args in curls:
        url = next(a for a in args if a.startswith("http")).replace("http://127.0.0.1:8000", served.url)
        body = args[args.index("-d") + 1].replace('"ckpt"', '"tiny"') if "-d" in args else None
        response = httpx.post(url, content=body, headers={"content-type": "application/json"}) if body else \
            httpx.get(url)
        assert response.status_code == 200, (args, response.text)


# --- bad input ---------------------------------------------------------------------------------------------------

LONG = " ".join("abcdefghij") * 4       # 80 tokens: past the context of 64

BAD_INPUTS = {
    # name: (path, raw body, status, words of the message)
    "prompt past the context": ("completions", {"prompt": LONG}, 400, ["context is 64 tokens"]),
    "max_tokens past the context": ("completions", {"prompt": PROMPT, "max_tokens": 60}, 400,
                                    ["max_tokens 60", "at most"]),
    "invalid JSON": ("completions", b'{"prompt": "hi",', 400, ["not valid JSON"]),
    "non-UTF-8 body": ("completions", b'{"prompt": "\xff\xfe"}', 400, ["not UTF-8"]),
    "not an object": ("completions", [1, 2], 400, ["JSON object"]),
    "unknown parameter": ("completions", {"prompt": "hi", "max_token": 3}, 400, ["unknown parameter 'max_token'"]),
    "negative temperature": ("completions", {"prompt": "hi", "temperature": -1}, 400, ["'temperature'"]),
    "n > 1": ("completions", {"prompt": "hi", "n": 2}, 400, ["'n'"]),
    "no prompt": ("completions", {"max_tokens": 3}, 400, ["missing parameter 'prompt'"]),
    "token id outside the vocabulary": ("completions", {"prompt": [1, 99]}, 400, ["outside the model's vocabulary"]),
    "two prompts": ("completions", {"prompt": ["a", "b"]}, 400, ["one prompt per request"]),
    "another model": ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, ["'gpt-4' does not exist"]),
    "no messages": ("chat/completions", {"messages": []}, 400, ["'messages'"]),
    "a bad role": ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, ["role"]),
    "image content": ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                      400, ["text content parts"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_json_error_and_the_server_keeps_serving(served, client, case):
    path, body, status, words = BAD_INPUTS[case]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{served.url}/v1/{path}", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] and all(word in error["message"] for word in words), error
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None


# --- faults (PacedEngine: the real engine, stepped when the test says) ---------------------------------------

def test_a_client_that_disconnects_mid_stream_has_its_request_aborted_and_blocks_freed(model, tokenizer):
    engine = PacedEngine(Engine(model, SOLO, CONFIG, tokenizer=tokenizer))
    with running_server(engine, tokenizer) as (server, errors):
        idle = engine.metrics().kv_blocks_used
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.Client() as http, http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            engine.allow(2)                      # the prefill (first token) and one decode step: 2 of 40 tokens
            engine.wait_steps(2)
            running = engine.metrics()
            assert running.running == 1 and running.kv_blocks_used > idle
            next(response.iter_lines())          # the stream has started; now the client goes away
        # No step is allowed: only an abort can end the request.
        _until(lambda: (engine.metrics().running, engine.metrics().kv_blocks_used) == (0, idle))
        now = engine.metrics()
        assert (now.running, now.waiting, now.kv_blocks_used) == (0, 0, idle), now
        assert _metrics(server)['megamoe_requests_finished_total{reason="abort"}'] == 1

        def give_up():                           # a non-streamed request whose client stops waiting
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=2.0)
        engine.allow(1)                          # the step that reports the abort (no model call)
        engine.wait_steps(3)
        impatient = threading.Thread(target=give_up)
        impatient.start()
        _until(lambda: engine.metrics().waiting == 1)
        engine.allow(1)                          # its prefill: it runs, holding blocks, until its client gives up
        engine.wait_steps(4)
        assert engine.metrics().running == 1 and engine.metrics().kv_blocks_used > idle
        impatient.join(60)
        _until(lambda: _metrics(server).get('megamoe_requests_finished_total{reason="abort"}') == 2)
        now = engine.metrics()
        assert (now.running, now.waiting, now.kv_blocks_used) == (0, 0, idle), now
        engine.open = True
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert not errors


def test_a_flood_is_answered_429_and_the_admitted_requests_complete(model, tokenizer):
    """Both bounds: the engine's queue (max_waiting 2) and the server's requests in flight (3)."""
    engine = PacedEngine(Engine(model, SOLO, EngineConfig(kv_cache_memory=1 << 20, block_size=4, max_num_seqs=1,
                                                          max_waiting=2), tokenizer=tokenizer))
    body = {"prompt": PROMPT, "max_tokens": 3}
    with running_server(engine, tokenizer, max_in_flight=3) as (server, errors):
        answers = []

        def send():
            answers.append(httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code)

        senders = [threading.Thread(target=send) for _ in range(3)]
        for sender in senders[:2]:
            sender.start()
        _until(lambda: engine.metrics().waiting == 2)            # no step has run: both wait
        full = httpx.post(server.url + "/v1/completions", json=body)
        assert full.status_code == 429 and "the queue is full" in full.json()["error"]["message"]
        engine.allow(1)                                         # one of them starts running
        _until(lambda: engine.metrics().running == 1)
        senders[2].start()
        _until(lambda: engine.metrics().waiting == 2)
        busy = httpx.post(server.url + "/v1/completions", json=body)
        assert busy.status_code == 429 and "3 requests are in flight" in busy.json()["error"]["message"]
        assert busy.json()["error"]["type"] == "rate_limit_error"
        engine.open = True
        for sender in senders:
            sender.join(120)
        assert answers == [200] * 3
        assert _metrics(server)['megamoe_requests_rejected_total{status="429"}'] == 2
    assert not errors


def test_an_engine_failure_answers_503_and_ends_the_server_with_its_error(model, tokenizer):
    engine = PacedEngine(Engine(model, SOLO, CONFIG, tokenizer=tokenizer))
    dead_rank = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")
    with running_server(engine, tokenizer) as (server, errors):
        engine.fail = dead_rank
        engine.open = True
        response = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert response.status_code == 503 and "Connection closed by peer" in response.json()["error"]["message"]
    assert errors == [dead_rank]                 # run() ended by itself with the engine's error


def test_an_idle_server_steps_its_engine_so_a_dead_rank_ends_it_without_any_request(model, tokenizer):
    """Under torchrun the followers wait in a collective for rank 0's next step: the heartbeat keeps them from
    timing out, and finds a rank that died while no request came."""
    engine = PacedEngine(Engine(model, SOLO, CONFIG, tokenizer=tokenizer))
    engine.open = True
    with running_server(engine, tokenizer, heartbeat_s=0.05) as (server, errors):
        engine.wait_steps(3)                     # no request: heartbeats
        dead_rank = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")
        engine.fail = dead_rank
        _until(lambda: errors)
    assert errors == [dead_rank]


# --- the command's mistakes: one error line, before the model loads ------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "ckpt"
    save_served_checkpoint(str(path))
    return path


def test_serve_command_mistakes_are_one_error_line(checkpoint, tmp_path, capsys, monkeypatch):
    from megamoe.cli.main import main
    from megamoe.serving.http.server import bind_socket
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    taken = bind_socket("127.0.0.1", 0)
    port = taken.getsockname()[1]
    import argparse
    from megamoe.cli.serve import byte_size
    assert (byte_size("1MiB"), byte_size("2e9"), byte_size("512")) == (1 << 20, 2 * 10 ** 9, 512)
    with pytest.raises(argparse.ArgumentTypeError, match="such as 4GiB"):
        byte_size("12XB")
    cases = [(["--max-num-seqs", "0"], ["--max-num-seqs must be an integer >= 1"]),
             (["--kv-cache-memory", "0"], ["--kv-cache-memory must be a number of bytes >= 1"]),
             (["--eplb-interval", "-1"], ["--eplb-interval must be an integer >= 0"]),
             (["--port", str(port)], [f"cannot listen on 127.0.0.1:{port}"]),
             (["--tokenizer", str(tmp_path / "nothing")], ["--tokenizer", "does not exist"]),
             (["--tp", "2"], ["do not fit 1 rank(s)"]),
             (["--data-parallel-attention", "--pp", "2"], ["--data-parallel-attention", "tp=1, pp=1", "got tp=1 pp=2"])]
    try:
        for flags, words in cases:
            assert main(["serve", str(checkpoint), *flags]) == 1, flags
            lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("megamoe serve: error: "), lines
            assert all(word in lines[0] for word in words), lines[0]
    finally:
        taken.close()


def test_megamoe_serve_serves_until_sigterm_then_exits_0(checkpoint, tokenizer, monkeypatch, capsys):
    """The command in this process (main thread, as the console script runs it): a request answered, then
    SIGTERM stops it gracefully with exit code 0."""
    import os
    import signal
    from megamoe.cli.main import main
    from megamoe.serving.http.server import bind_socket
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    probe = bind_socket("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    url = f"http://127.0.0.1:{port}"
    answers = []

    def client():
        for _ in range(1200):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                threading.Event().wait(0.05)
        answers.append(httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                                 "temperature": 0}, timeout=120).json())
        os.kill(os.getpid(), signal.SIGTERM)
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    code = main(["serve", str(checkpoint), "--port", str(port), "--served-model-name", "tiny",
                 "--kv-cache-memory", "1MiB", "--block-size", "4"])
    thread.join(60)
    assert code == 0
    assert answers and answers[0]["usage"]["completion_tokens"] == 4, answers
    out = capsys.readouterr().out
    assert f"megamoe serve: serving tiny at {url}/v1" in out, out
