"""Shared by tests/unit/test_serve_http.py and tests/multirank/test_serve_command.py: a tiny chat tokenizer (64
tokens, byte fallback, a ChatML template), the tiny Qwen3-MoE it fits, OpenAI servers over it in a thread, and
a test double that paces the real engine's steps (for the fault tests only)."""

import contextlib
import os
import threading
import time

from tests.helpers.hf_models import V

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2
# "€" is three byte tokens: a streamed text must never show half of it.
BYTES = ["<0x0A>", "<0xE2>", "<0x82>", "<0xAC>"]
PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyz", *".,?!", *"0123456789"]


def save_chat_tokenizer(directory) -> None:
    """A sentencepiece-style BPE (no merges: one token per character, byte fallback) of exactly V tokens with a
    ChatML chat template, saved by transformers."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    pieces = SPECIALS + BYTES + PIECES
    pieces += [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"][:V - len(pieces)]
    assert len(pieces) == V
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(os.fspath(directory))


def save_served_checkpoint(path):
    """The tiny Qwen3-MoE (tests.helpers.inference) as a megamoe checkpoint with the chat tokenizer in its
    hf_files/ (where ``megamoe serve`` looks by default); returns the model."""
    from megamoe.checkpoint.format import save_checkpoint
    from megamoe.checkpoint.manifest_fields import HF_FILES_DIR
    from megamoe.checkpoint_state import sharded_state_dict
    from tests.helpers.inference import _our_model
    model = _our_model("qwen3_moe")
    save_checkpoint(path, sharded_state_dict(model), manifest_fields={"model_config": model.config.to_dict()})
    save_chat_tokenizer(os.path.join(path, HF_FILES_DIR))
    return model


@contextlib.contextmanager
def running_server(engine, tokenizer, *, model_name="tiny", max_in_flight=16, **options):
    """An OpenAIServer (``options``: its other arguments) on a free port of 127.0.0.1 in a thread; yields
    (server, errors): ``errors`` gets what ``run()`` raised."""
    from megamoe.inference.generation import max_sequence_length
    from megamoe.serving.http.server import OpenAIServer
    config = engine.model.config
    server = OpenAIServer(engine, tokenizer, model_name=model_name, vocab_size=config.vocab_size,
                          context_length=max_sequence_length(config), max_in_flight=max_in_flight, **options)
    errors = []

    def run():
        try:
            server.run()
        except BaseException as error:      # noqa: BLE001 - the test reads it
            errors.append(error)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert server.started.wait(60), "the server did not start"
    try:
        yield server, errors
    finally:
        server.shutdown()
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"


class PacedEngine:
    """Test double for the fault tests: the real engine, whose steps run only when the test allows them
    (:meth:`allow`), so that a request is certainly unfinished when its client goes away or the queue fills.
    A step without permission returns no output (the engine loop still takes requests and aborts). ``fail``:
    the exception the next allowed step raises (a dead rank)."""

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.model
        self.config = engine.config
        self._permits = threading.Semaphore(0)
        self.open = False
        self.steps = 0
        self.fail = None

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def wait_steps(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.steps < count:
            assert time.monotonic() < deadline, f"the engine ran {self.steps} steps, not {count}"
            time.sleep(0.01)

    def add_request(self, *args):
        return self.engine.add_request(*args)

    def abort(self, request_id):
        return self.engine.abort(request_id)

    def has_unfinished(self):
        return self.engine.has_unfinished()

    def metrics(self):
        return self.engine.metrics()

    def step(self):
        if not (self.open or self._permits.acquire(timeout=0.01)):
            return []
        if self.fail is not None:
            raise self.fail
        outputs = self.engine.step()
        self.steps += 1
        return outputs
