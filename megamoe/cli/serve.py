"""``megamoe serve``: an OpenAI-compatible HTTP server over a checkpoint, with continuous batching over a paged
KV cache (:mod:`megamoe.serving`)::

    megamoe serve CKPT --host 127.0.0.1 --port 8000
    torchrun --nproc-per-node 2 -m megamoe serve CKPT --tp 2 --port 8000
    torchrun --nproc-per-node 2 -m megamoe serve CKPT --ep 2 --data-parallel-attention --port 8000

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``/v1/models``, ``/health`` and
``/metrics`` (Prometheus text). Under torchrun, rank 0 serves HTTP and schedules every step, and the other
ranks follow its steps; with ``--data-parallel-attention`` (tp 1, pp 1: EP spans the data-parallel ranks) each
data-parallel rank schedules the requests rank 0 assigns it (:mod:`megamoe.serving.data_parallel`). ``--port 0``
takes any free port; the first line printed says where it listens.

Chats are rendered by the chat template of the tokenizer files (``--tokenizer``, by default
``CKPT/hf_files/`` if present, else ``CKPT``, as ``megamoe generate`` finds them). The default stop tokens are
the tokenizer's EOS (and those of a ``generation_config.json`` beside it).

Flags and the checkpoint are checked before anything is loaded: a mistake is one ``error:`` line and exit
code 1. The server stops on Ctrl-C or SIGTERM (exit 0); a rank that dies or a collective that times out ends
it with an ``error:`` line and exit code 1, never a hang.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from megamoe.checkpoint.format import read_manifest
from megamoe.checkpoint.manifest_fields import HF_FILES_DIR
from megamoe.checkpoint.model_manifest import check_model_manifest
from megamoe.cli.generate import (add_layout_arguments, check_layout, engine_choices, join_layout, load_model,
                                  tokenizer_path)
from megamoe.cli.launch import HelpFormatter, ScriptArgumentParser, run_script
from megamoe.errors import UsageError
from megamoe.inference.generation import max_sequence_length
from megamoe.process_group import launch_rank, launch_world_size, resolve_device

logger = logging.getLogger(__name__)

PROG = "megamoe serve"
HEARTBEAT_S = 10.0           # under torchrun, an idle rank 0 steps the engine this often (the followers' collectives)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "t": 1000 ** 4, "tb": 1000 ** 4}
# EngineConfig field -> the flag that sets it (its ValueErrors name the field).
FLAG_OF_FIELD = {"block_size": "--block-size", "kv_cache_memory": "--kv-cache-memory",
                 "max_num_batched_tokens": "--max-num-batched-tokens", "max_num_seqs": "--max-num-seqs",
                 "max_waiting": "--max-waiting", "enable_prefix_caching": "--no-prefix-caching",
                 "speculative_tokens": "--speculative-tokens", "data_parallel_attention": "--data-parallel-attention",
                 "eplb_interval": "--eplb-interval"}


def byte_size(text: str) -> int:
    """``4GiB``, ``512MiB``, ``2e9``, ``1000000`` -> bytes (argparse type)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB, 512MiB or 1000000 (bytes), got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535] (0: any free port), got {text!r}")
    return port


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = ScriptArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("checkpoint", type=Path, help="megamoe checkpoint directory (holding manifest.json)")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    h.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free port, printed at start)")
    h.add_argument("--served-model-name", default=None,
                   help="the model id of /v1/models and the requests' \"model\" (default: the checkpoint path as "
                        "given)")
    h.add_argument("--tokenizer", type=Path, default=None,
                   help=f"tokenizer file or directory (default: CKPT/{HF_FILES_DIR} if present, else CKPT)")
    e = p.add_argument_group("engine (defaults: megamoe.serving.EngineConfig's)")
    e.add_argument("--kv-cache-memory", type=byte_size, default=None, metavar="BYTES",
                   help="KV-cache pool size, e.g. 2GiB (default: a fraction of the free memory)")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    e.add_argument("--max-num-seqs", type=int, default=None, help="requests running in one step at most")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens (decode tokens + prefill chunks) per step at most")
    e.add_argument("--max-waiting", type=int, default=None,
                   help="requests waiting to start at most; more are answered 429")
    e.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share the KV blocks of common prompt prefixes between requests")
    e.add_argument("--speculative-tokens", type=int, default=None,
                   help="MTP draft tokens per step (models with MTP layers; 0: no speculation)")
    e.add_argument("--eplb-interval", type=int, default=None, metavar="N",
                   help="re-place the expert slots every N engine steps from those steps' expert load, replicas "
                        "of hot experts where there are more slots than experts (0: never)")
    add_layout_arguments(p)
    return p


def engine_config(args, engine_config_class):
    """The engine flags as an EngineConfig (the engine's defaults where a flag is not given); UsageError
    naming the flag."""
    fields = {"block_size": args.block_size, "kv_cache_memory": args.kv_cache_memory,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_waiting": args.max_waiting, "speculative_tokens": args.speculative_tokens,
              "eplb_interval": args.eplb_interval}
    given = {name: value for name, value in fields.items() if value is not None}
    if not args.prefix_caching:
        given["enable_prefix_caching"] = False
    if args.data_parallel_attention:
        given["data_parallel_attention"] = True
    try:
        config = engine_config_class(**given)
        if config.data_parallel_attention:        # before anything loads: the layouts the engine runs it with
            from megamoe.serving.data_parallel import check_data_parallel_layout
            check_data_parallel_layout(args.tp, args.pp, config.speculative_tokens)
    except ValueError as error:
        raise UsageError(re.sub(r"\bEngineConfig\.(\w+)", lambda m: FLAG_OF_FIELD.get(m.group(1), m.group(0)),
                                str(error))) from None
    return config


def load_serving_tokenizer(args):
    from megamoe.serving.http.tokenizer import ServingTokenizer
    path = tokenizer_path(args)
    try:
        return ServingTokenizer.from_path(path)
    except (OSError, ValueError, ImportError) as error:
        flag = "--tokenizer" if args.tokenizer is not None else "the checkpoint's tokenizer"
        raise UsageError(f"{flag} {path}: {error}; the server needs the model's tokenizer: pass --tokenizer "
                         "FILE_OR_DIR (HF tokenizer files, or a sentencepiece .model)") from None


def check_serving_packages() -> None:
    missing = []
    for name in ("fastapi", "uvicorn", "transformers"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(f"serving needs {', '.join(missing)}: pip install -e '.[serve]'")


def main(argv=None, *, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO if launch_rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    serving = launch_rank() == 0         # rank 0 serves HTTP; the other ranks need no tokenizer nor web stack
    if serving:
        check_serving_packages()
    from megamoe.serving import Engine, EngineConfig
    config = engine_config(args, EngineConfig)
    device = resolve_device(args.device)
    saved = check_model_manifest(read_manifest(args.checkpoint), args.checkpoint)
    world = launch_world_size()
    dispatcher = check_layout(args, saved, world)
    if config.eplb_interval and saved.moe is None:
        raise UsageError("--eplb-interval: the checkpoint's model has no MoE layer, so there is no expert to "
                         "rebalance; leave the flag out")
    tokenizer, sock = None, None
    if serving:
        tokenizer = load_serving_tokenizer(args)
        if tokenizer.vocab_size > saved.vocab_size:
            raise UsageError(f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the "
                             f"model's vocabulary of {saved.vocab_size}: pass this model's --tokenizer")
        from megamoe.serving.http.server import bind_socket
        sock = bind_socket(args.host, args.port)     # before the model loads: a port in use fails fast

    state = join_layout(args, dispatcher, world, device)
    model = load_model(args, engine_choices(args, saved, dispatcher), state, device)
    engine = Engine(model, state, config, tokenizer=tokenizer)
    if state.rank != 0:
        engine.follow()                  # runs rank 0's steps until rank 0 stops serving
        return 0
    from megamoe.serving.http.server import OpenAIServer
    name = args.served_model_name or str(args.checkpoint)
    replicas = state.dp.size if config.data_parallel_attention else 1     # each holds its own running and waiting
    server = OpenAIServer(engine, tokenizer, model_name=name, vocab_size=saved.vocab_size,
                          context_length=max_sequence_length(saved),
                          max_in_flight=replicas * (engine.config.max_num_seqs + engine.config.max_waiting), sock=sock,
                          heartbeat_s=min(args.comm_timeout / 4, HEARTBEAT_S) if world > 1 else None)
    layout = f", data-parallel attention over {replicas} ranks" if replicas > 1 else ""
    print(f"{prog}: serving {name} at {server.url}/v1 (world {state.world_size}{layout}); Ctrl-C stops", flush=True)
    server.run()                         # raises the engine's error (a dead rank, a timed-out collective)
    if world > 1:
        engine.shutdown()                # the followers return from follow()
    logger.info("stopped serving")
    return 0


def cli(argv=None) -> int:
    """``megamoe serve``: :func:`main` with one-line errors (:func:`megamoe.cli.launch.run_script`)."""
    return run_script(main, argv, prog=PROG)
