"""Chat SFT data (megamoe.data.chat_*): the assistant mask equals transformers' on templates with
``{% generation %}``; without markers the prefix rule trains each assistant turn with its end-of-turn token;
prompt/completion records; packing with truncate/drop; bad data names ``file:line``; and ``megamoe train
--data chats.jsonl`` trains on the assistant tokens only (the step's loss is the mean over them, checked
against the conversations tokenized by transformers and run one by one)."""

import json
import logging

import numpy as np
import pytest
import torch

from megamoe.cli.launch import run_script
from megamoe.data.chat_data import ChatEncoder, encode_chat_file
from megamoe.data.chat_documents import ChatDocuments, bounds_of, load_chat_documents, save_chat_documents
from megamoe.data.chat_samples import ChatSamples, split_chat_documents
from megamoe.data.chat_template import load_chat_template
from megamoe.data.eval_split import IGNORE_INDEX
from megamoe.data.tokenizer import Tokenizer
from tests.helpers.chat_data import (CHATML_GENERATION, CHATML_PLAIN, CONVERSATIONS, QWEN3_STYLE, REASONING_CONVERSATION,
                                     TOOLS, save_chat_tokenizer, write_jsonl)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """{template name: tokenizer directory}: one tokenizer, three templates (one in chat_template.jinja)."""
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {"generation": save_chat_tokenizer(root / "generation", CHATML_GENERATION, jinja_file=True),
            "plain": save_chat_tokenizer(root / "plain", CHATML_PLAIN),
            "qwen3": save_chat_tokenizer(root / "qwen3", QWEN3_STYLE)}


def _encoder(directory):
    return ChatEncoder(Tokenizer.from_path(directory), load_chat_template(directory))


def _hf_mask(directory, conversation, tools=None):
    """transformers' apply_chat_template(..., return_assistant_tokens_mask=True): (ids, mask)."""
    from transformers import AutoTokenizer
    out = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        conversation, tools=tools, return_assistant_tokens_mask=True, return_dict=True)
    return out["input_ids"], [bool(m) for m in out["assistant_masks"]]


def test_generation_markers_give_transformers_assistant_mask(tokenizers):
    encoder = _encoder(tokenizers["generation"])
    assert encoder.rule == "generation"
    cases = [(c, None) for c in CONVERSATIONS] + [(REASONING_CONVERSATION, None), (CONVERSATIONS[2], TOOLS)]
    for conversation, tools in cases:
        (ids, mask), = encoder.encode(conversation, tools=tools)
        hf_ids, hf_mask = _hf_mask(tokenizers["generation"], conversation, tools)
        assert ids.tolist() == hf_ids and mask.tolist() == hf_mask
        assert 0 < mask.sum() < mask.size
    (ids, mask), = encoder.encode(REASONING_CONVERSATION)
    assert encoder.tokenizer.decode(ids[mask].tolist()) == "<think>2 + 2 = 4</think>four<|im_end|>"
    # tojson as transformers': no HTML escaping of the tool call's arguments, which are trained.
    (ids, mask), = encoder.encode(CONVERSATIONS[2])
    assert '<tool_call>{"name": "weather", "arguments": {"city": "<Paris> & co"}}</tool_call><|im_end|>' in \
        encoder.tokenizer.decode(ids[mask].tolist())


def test_generation_prompt_is_transformers_add_generation_prompt(tokenizers):
    from transformers import AutoTokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    for directory in tokenizers.values():
        text, ids = _encoder(directory).generation_prompt(messages)
        hf = AutoTokenizer.from_pretrained(directory)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ids == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"]


def _trained_texts(encoder, conversation):
    return [encoder.tokenizer.decode(ids[mask].tolist()) for ids, mask in encoder.encode(conversation)]


def test_prefix_rule_trains_each_turn_and_its_end_of_turn(tokenizers, tmp_path, caplog):
    # Every turn rendered the same wherever it stands: one document; the mask is transformers' on the same
    # template with markers, plus the "\n" each turn's end-of-turn marker is followed by (the text it adds).
    plain = _encoder(tokenizers["plain"])
    assert plain.rule == "prefix"
    newline = plain.tokenizer.encode("\n")
    for conversation in CONVERSATIONS:
        (ids, mask), = plain.encode(conversation)
        hf_ids, hf_mask = _hf_mask(tokenizers["generation"], conversation)
        assert ids.tolist() == hf_ids
        expected = [m or (i > 0 and hf_mask[i - 1] and [t] == newline) for i, (t, m) in enumerate(zip(hf_ids, hf_mask))]
        assert mask.tolist() == expected
    # Qwen3's style (the last turn with a think block, history without): one document per assistant turn, each
    # trained on what the model generates for that turn, its end-of-turn token <|im_end|> (the EOS) included.
    qwen = _encoder(tokenizers["qwen3"])
    eos = qwen.tokenizer.eos_id
    assert _trained_texts(qwen, CONVERSATIONS[1]) == ["<think>\n\n</think>\n\nfour<|im_end|>\n",
                                                      "<think>\n\n</think>\n\nthe cat sat on the mat<|im_end|>\n"]
    first, second = qwen.encode(CONVERSATIONS[1])
    assert all(eos in ids[mask].tolist() for ids, mask in (first, second))
    history = qwen.tokenizer.decode(second[0][~second[1]].tolist())
    assert "<|im_start|>assistant\nfour<|im_end|>" in history        # the earlier turn is context, not trained
    # The rule is logged once per file.
    caplog.set_level(logging.INFO, logger="megamoe.data.chat_data")
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS])
    documents = encode_chat_file(path, qwen)
    assert [r.getMessage().split(": ", 1)[1][:11] for r in caplog.records].count("prefix rule") == 1
    assert documents.num_conversations == 3 and documents.num_documents == 5


def test_prompt_completion_records_are_a_user_and_an_assistant_turn_with_their_tools(tokenizers, tmp_path):
    encoder = _encoder(tokenizers["generation"])
    system = {"role": "system", "content": "be brief"}
    path = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "hello there", "completion": "fine"},
        {"prompt": [system, {"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}],
         "tools": TOOLS}])
    documents = encode_chat_file(path, encoder)
    expected = [encoder.encode([{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "fine"}]),
                encoder.encode([system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                               tools=TOOLS)]
    assert "# Tools" in encoder.tokenizer.decode(documents.ids[documents.offsets[1]:].tolist())
    for d, ((ids, mask),) in enumerate(expected):
        s, e = documents.offsets[d], documents.offsets[d + 1]
        assert documents.ids[s:e].tolist() == ids.tolist() and documents.assistant[s:e].tolist() == mask.tolist()


def _documents(lengths, trained_from):
    """Documents of ``lengths`` tokens (document d's ids 1000 * (d + 1) + position), assistant tokens from
    ``trained_from[d]`` on."""
    ids = np.concatenate([1000 * (d + 1) + np.arange(n) for d, n in enumerate(lengths)])
    assistant = np.concatenate([np.arange(n) >= t for n, t in zip(lengths, trained_from)])
    return ChatDocuments(ids, assistant, bounds_of(lengths), bounds_of([1] * len(lengths)))


def test_packing_keeps_documents_whole_and_labels_only_assistant_tokens():
    lengths, trained_from, pad = [5, 9, 4, 13, 3], [3, 2, 1, 6, 2], 7
    samples = ChatSamples(_documents(lengths, trained_from), 8, overlong="truncate", pad_id=pad)
    # Document d takes n - 1 positions; the 13-token one is cut to 8 (--seq-len), the 9-token one just fits.
    assert samples.stats["overlong"] == samples.stats["truncated"] == 1 and samples.stats["dropped"] == 0
    batch = samples.micro_batch(list(range(len(samples))))
    placed = []
    for row in range(len(samples)):
        for segment in batch.document_ids[row].unique().tolist():
            at = (batch.document_ids[row] == segment).nonzero()[:, 0]
            inputs, labels = batch.inputs[row, at], batch.labels[row, at]
            assert batch.position_ids[row, at].tolist() == list(range(at.numel()))
            if inputs[0] == pad:
                assert (inputs == pad).all() and (labels == IGNORE_INDEX).all()
                continue
            d = int(inputs[0]) // 1000 - 1
            placed.append(d)
            n = at.numel()
            assert n == min(lengths[d] - 1, 8) and int(inputs[0]) == 1000 * (d + 1)   # whole, from its start
            ids = 1000 * (d + 1) + torch.arange(1, n + 1)
            assert labels.tolist() == torch.where(torch.arange(1, n + 1) >= trained_from[d], ids, IGNORE_INDEX).tolist()
    assert sorted(placed) == list(range(len(lengths)))            # every document once, never split
    assert samples.stats["labelled_tokens"] == int((batch.labels != IGNORE_INDEX).sum())
    # drop: the overlong one goes; under truncate a document whose assistant tokens all lie past --seq-len goes.
    dropped = ChatSamples(_documents(lengths, trained_from), 8, overlong="drop")
    assert dropped.stats["dropped"] == 1 and len(dropped.lengths) == 4
    late = ChatSamples(_documents([5, 20], [3, 15]), 8, overlong="truncate")
    assert late.stats["dropped_without_label"] == 1 and late.lengths.tolist() == [4]
    with pytest.raises(ValueError, match="no document leaves an assistant token"):
        ChatSamples(_documents([20], [15]), 8)


def test_eval_batches_of_chat_rows_carry_their_document_masks():
    from megamoe.data.eval_split import eval_batches
    from megamoe.data.packing import MicroBatch
    samples = ChatSamples(_documents([5, 9, 4], [3, 2, 1]), 8)                # 2 rows: 8 | 4 + 3 positions
    (first, second), = eval_batches(samples, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1)
    assert isinstance(first, MicroBatch)
    expected = samples.micro_batch([0, 1])
    assert all(torch.equal(a, b) for a, b in zip(first, expected))
    assert sorted(first.document_ids[1].unique().tolist()) == [0, 1, 2]     # two documents and the padding
    assert (second.labels == IGNORE_INDEX).all() and second.document_ids is not None   # past the end: no label


def test_documents_file_round_trip_and_split_by_conversation(tmp_path):
    documents = ChatDocuments(np.arange(12), np.arange(12) % 3 == 0, bounds_of([3, 4, 5]), bounds_of([1, 2]),
                              {"rule": "prefix"})
    save_chat_documents(documents, tmp_path / "d.chat.safetensors")
    back = load_chat_documents(tmp_path / "d.chat.safetensors", vocab_size=12)
    assert back.ids.tolist() == documents.ids.tolist() and back.assistant.tolist() == documents.assistant.tolist()
    assert back.offsets.tolist() == [0, 3, 7, 12] and back.conversations.tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        load_chat_documents(tmp_path / "d.chat.safetensors", vocab_size=11)
    (tmp_path / "bad.chat.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="cannot read chat documents"):
        load_chat_documents(tmp_path / "bad.chat.safetensors")
    train, held = split_chat_documents(back, 0.5, seed=0)
    assert train.num_conversations == held.num_conversations == 1
    assert sorted([train.num_documents, held.num_documents]) == [1, 2]          # conversation 1 keeps its 2
    assert sorted(train.ids.tolist() + held.ids.tolist()) == list(range(12))


def _bad_files(tmp_path):
    ok = {"messages": CONVERSATIONS[0]}
    cases = {
        "invalid JSON": ['{"messages": [', r"not valid JSON"],
        "not UTF-8": [b'{"prompt": "caf\xe9", "completion": "x"}', r"not UTF-8"],
        "missing role": [{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}, r"has no role"],
        "unknown role": [{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
                         r"unknown role 'robot'"],
        "no assistant turn": [{"messages": [{"role": "user", "content": "hi"}]}, r"no assistant turn"],
        "template fails": [{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                                         {"role": "assistant", "content": "x"}]},
                           r"fails to render.*the system message must come first"],
    }
    files = {}
    for name, (bad, pattern) in cases.items():
        path = tmp_path / (name.replace(" ", "_") + ".jsonl")
        lines = [json.dumps(ok).encode(), b"", bad if isinstance(bad, bytes) else
                 (bad if isinstance(bad, str) else json.dumps(bad)).encode()]
        path.write_bytes(b"\n".join(lines) + b"\n")
        files[name] = (path, pattern)
    return files


def test_bad_data_names_file_and_line(tokenizers, tmp_path):
    encoder = _encoder(tokenizers["generation"])
    for name, (path, pattern) in _bad_files(tmp_path).items():
        with pytest.raises(ValueError, match=f"^{path}:3: .*{pattern}"):
            encode_chat_file(path, encoder)


TINY = ["--hidden", 32, "--layers", 2, "--experts", 4, "--top-k", 2, "--seq-len", 96, "--micro-batch", 1,
        "--sample-tokens", 0, "--save-every", 100, "--expert-backend", "torch", "--autocast", "none", "--no-progress"]


def test_train_on_chat_jsonl_takes_the_loss_on_assistant_tokens_only(demo, tokenizers, tmp_path, capsys, monkeypatch):
    # demo: a plain one-process run (no torchrun environment), as `megamoe train` in this process.
    from megamoe.cli import train as train_command
    from megamoe.training.trainer import Trainer
    tok_dir = tokenizers["qwen3"]
    records = [{"messages": c} for c in CONVERSATIONS] + [{"prompt": "hello there", "completion": "fine"}]
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    # The oracle: the documents as transformers renders them prefix by prefix, each run alone through the model
    # as it is before the step; the loss is the mean over their assistant tokens.
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tok_dir)
    documents = []
    for record in records:
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]},
                                              {"role": "assistant", "content": record["completion"]}]
        for i in [i for i, m in enumerate(messages) if m["role"] == "assistant"]:
            prompt = hf.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
            turn = hf.apply_chat_template(messages[:i + 1], tokenize=False)
            ids = hf(turn, add_special_tokens=False)["input_ids"]
            trained = len(ids) - len(hf(prompt, add_special_tokens=False)["input_ids"])
            documents.append((ids, trained))
    # Conversation 1 renders its turns differently (the think block), so each makes a document; so does 2.
    assert len(documents) == 6
    seen = {}
    original = Trainer.train_step

    def train_step(self, micro_batches):
        if not seen:
            total, count = 0.0, 0
            with torch.no_grad():
                for ids, trained in documents:
                    ids = torch.tensor([ids])
                    labels = ids[:, 1:].clone()
                    labels[:, :-trained] = IGNORE_INDEX
                    loss, _ = self.model(ids[:, :-1], labels=labels)
                    total, count = total + float(loss) * trained, count + trained
            seen["oracle"] = total / count
            seen["labelled"] = [int((b[1] != IGNORE_INDEX).sum()) for b in micro_batches]
        metrics = original(self, micro_batches)
        seen.setdefault("loss", metrics.loss)
        return metrics

    monkeypatch.setattr(Trainer, "train_step", train_step)
    # One global batch of every row (4 rows of 96 tokens hold the 6 documents, best fit).
    # The end-of-run samples answer --sample-prompt as a user turn of the chat template, as transformers renders it.
    argv = ["--tokenizer", tok_dir, "--data", data, "--work-dir", tmp_path / "work", "--steps", 1,
            "--global-batch", 4, *TINY, "--sample-tokens", 2, "--sample-prompt", "hello there"]
    code = run_script(train_command.main, [str(a) for a in argv], prog=train_command.PROG)
    out, err = capsys.readouterr()
    assert code == 0, err
    chat_prompt = hf.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                         tokenize=False)
    assert f"--- greedy sample ---\n{chat_prompt}" in out
    assert sum(seen["labelled"]) == sum(trained for _, trained in documents)
    assert len(set(seen["labelled"])) > 1           # micro-batches of unequal weight: the mean is per token
    assert seen["loss"] == pytest.approx(seen["oracle"], rel=1e-5)
    # Bad data: one error line naming file:line, before any training, nothing cached for it.
    path, _ = _bad_files(tmp_path)["unknown role"]
    argv = ["--tokenizer", tok_dir, "--data", path, "--work-dir", tmp_path / "bad", "--steps", 1,
            "--global-batch", 4, *TINY]
    assert run_script(train_command.main, [str(a) for a in argv], prog=train_command.PROG) == 1
    _, err = capsys.readouterr()
    assert err.strip().splitlines()[-1].startswith(f"megamoe train: error: {path}:3: message 0 of messages has the "
                                                   "unknown role 'robot'")
    assert "Traceback" not in err
    assert not list((tmp_path / "bad").rglob("*.safetensors"))


def test_checkpoints_and_exports_carry_the_chat_template_file(tokenizers):
    from megamoe.training.hf_export import tokenizer_side_files
    files = tokenizer_side_files(Tokenizer.from_path(tokenizers["generation"]))
    assert files["chat_template.jinja"].decode() == CHATML_GENERATION


def test_a_chat_run_refuses_other_data_weights_packing_flags_and_a_tokenizer_without_template(demo, tokenizers,
                                                                                               tmp_path, capsys):
    from megamoe.cli import train as train_command
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CONVERSATIONS[0]}])
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello"}])
    no_template = save_chat_tokenizer(tmp_path / "no_template", None)
    cases = {
        "other data": (["--data", chats, text], f"but --data {text} is not: train chat and other data in separate"),
        "weights": (["--data", chats, chats, "--data-weights", 1, 2], "--data-weights does not apply to chat data"),
        "packing flag": (["--data", chats, "--eod-mask-loss"], "--eod-mask-loss: not for chat data"),
        "no template": (["--data", chats, "--tokenizer", no_template], "chat data needs the tokenizer's chat template"),
    }
    for name, (argv, message) in cases.items():
        argv = ["--tokenizer", tokenizers["generation"], "--work-dir", tmp_path / name, *TINY, *argv]
        assert run_script(train_command.main, [str(a) for a in argv], prog=train_command.PROG) == 1, name
        _, err = capsys.readouterr()
        assert err.strip().splitlines()[-1].startswith("megamoe train: error: ") and message in err, (name, err)
