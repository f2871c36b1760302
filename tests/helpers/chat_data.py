"""Shared by the chat-data tests: a tiny byte-level BPE HF tokenizer with ChatML's special tokens, chat
templates written for the tests (ChatML with ``{% generation %}`` markers; a Qwen3-style one without
markers that shows the last assistant turn with an empty ``<think>`` block and earlier ones without), and
chat JSON Lines files."""

import json
import os

CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML; the assistant's reasoning, content (tool calls as JSON: the tojson filter) and its end-of-turn
# marker are the generation; the tools offered open the chat; a system message after the first is an error
# (raise_exception).
CHATML_GENERATION = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' + tools | tojson + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{% if message.reasoning_content %}{{ '<think>' + message.reasoning_content + '</think>' }}{% endif %}"
    "{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}{{ '<tool_call>' + call.function | tojson + '</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# No markers. An assistant turn after the last user turn that is the conversation's last message is
# shown with an empty think block; every other one without (as Qwen3's template renders history).
QWEN3_STYLE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "{% if loop.index0 > ns.last_user and loop.last %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Every turn rendered the same wherever it stands (no markers): one document per conversation.
CHATML_PLAIN = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CORPUS = ["hello there, how are you today? I am fine, thank you.", "the cat sat on the mat and the dog barked",
          "what is two plus two? four. tell me a joke about tools and weather", "system: be brief and helpful"]


def save_chat_tokenizer(directory, template=CHATML_GENERATION, *, jinja_file=False):
    """A byte-level BPE tokenizer (any text encodes) with ChatML's special tokens, eos ``<|im_end|>``, pad
    ``<|endoftext|>``, and ``template`` in tokenizer_config.json (or chat_template.jinja); returns ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=CHAT_SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if jinja_file:
        with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
            f.write(template)
    elif template is not None:
        config["chat_template"] = template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
     {"role": "assistant", "content": "I am fine, thank you."}],
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four"},
     {"role": "user", "content": "tell me a joke"}, {"role": "assistant", "content": "the cat sat on the mat"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "<Paris> & co"}}}]},
     {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "it is sunny"}],
]

# A reasoning under one of its other names (transformers passes it as reasoning_content), and tools offered.
REASONING_CONVERSATION = [{"role": "user", "content": "two plus two?"},
                          {"role": "assistant", "content": "four", "reasoning": "2 + 2 = 4"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "description": "a <city> name"}}}}}]


def write_jsonl(path, records):
    """``records`` (dicts, or strings written as they are) one per line; returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)
