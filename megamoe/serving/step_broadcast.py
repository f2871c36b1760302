"""Under torchrun: rank 0 owns the requests and tells every other rank what each engine step starts from.

Every rank of a model runs every engine step together: TP ranks split each layer, pipeline stages pass the
step's hidden states on, EP ranks exchange the step's tokens in the MoE layers. So every rank must hold the
same requests and run the same schedule. Rank 0 (the HTTP server's rank) is the only one that hears of
requests; before each step its engine broadcasts, over the world group, what changed since the last step, in
the order it happened: requests added (id, prompt, sampling parameters, and the data-parallel rank that serves
it), requests aborted, and requests rank 0 ended on a stop string (the other ranks may have no tokenizer; they
get no stop strings and drop those requests here). Every other rank runs :meth:`Engine.follow`: it receives,
applies the same changes to its own engine and runs the same step. The scheduler is deterministic (it depends only on the requests, their order and
the KV pool's size, which the ranks agree on when the engine starts: :func:`agree_num_blocks`), and the new
tokens are the same on every rank (the logits are gathered over TP before sampling, and the last pipeline
stage broadcasts them), so the steps stay identical without sending the schedule itself. To catch a
divergence anyway, each message carries a digest of rank 0's previous schedule (request ids and token
counts), which every rank compares with its own (RuntimeError on a mismatch, never silently different steps).

Under data-parallel attention (:mod:`megamoe.serving.data_parallel`) each data-parallel rank holds only the
requests added for it and runs its own schedule: there the digest is not kept (0 on every rank).

:meth:`Engine.shutdown` on rank 0 sends the message that ends ``follow()`` elsewhere. A rank that dies leaves
the others waiting in a broadcast or a model collective: the process group's timeout ends them with
:class:`~megamoe.collective_timeout.CollectiveTimeout`, naming the missing rank (never a hang).

The message is one int64 tensor (its length broadcast first): floats travel as their IEEE-754 bits, so the
sampling parameters arrive exactly.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.serving.sampling_params import SamplingParams

__all__ = ["StepMessage", "AddRequest", "StepBroadcast", "agree_num_blocks", "schedule_digest"]

_MAGIC = 0x5E4E_0002                   # format of the message; a follower refuses any other
ADD, ABORT, STOPPED = 1, 2, 3


@dataclass(frozen=True)
class AddRequest:
    """A request to add; under data-parallel attention only on the ranks of data-parallel rank ``dp_rank``
    (:mod:`megamoe.serving.data_parallel`)."""

    request_id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    dp_rank: int = 0


@dataclass
class StepMessage:
    """What rank 0 tells the others before a step: the changes since the last one, in order (``AddRequest``,
    or ``(ABORT, id)`` / ``(STOPPED, id)``), the digest of its previous schedule, and whether to shut down."""

    changes: list = field(default_factory=list)
    previous_digest: int = 0
    shutdown: bool = False


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def encode(message: StepMessage) -> list[int]:
    out = [_MAGIC, int(message.shutdown), message.previous_digest, len(message.changes)]
    for change in message.changes:
        if isinstance(change, AddRequest):
            p = change.params
            out += [ADD, change.request_id, len(change.prompt), *change.prompt, p.max_tokens, p.seed,
                    -1 if p.top_k is None else p.top_k, _float_bits(p.temperature), _float_bits(p.top_p),
                    int(p.logprobs), len(p.stop_token_ids), *p.stop_token_ids, change.dp_rank]
        else:
            kind, request_id = change
            out += [kind, request_id]
    return out


def decode(values: list[int]) -> StepMessage:
    if not values or values[0] != _MAGIC:
        raise RuntimeError("the step message from rank 0 is not in this version's format: every rank must run the "
                           "same megamoe")
    message = StepMessage(previous_digest=values[2], shutdown=bool(values[1]))
    at = 4
    for _ in range(values[3]):
        kind = values[at]
        if kind == ADD:
            request_id, length = values[at + 1], values[at + 2]
            at += 3
            prompt = tuple(values[at:at + length])
            at += length
            max_tokens, seed, top_k, temperature, top_p, logprobs, num_stops = values[at:at + 7]
            at += 7
            stops = tuple(values[at:at + num_stops])
            dp_rank = values[at + num_stops]
            at += num_stops + 1
            params = SamplingParams(temperature=_bits_float(temperature), top_k=None if top_k < 0 else top_k,
                                    top_p=_bits_float(top_p), seed=seed, max_tokens=max_tokens, stop_token_ids=stops,
                                    logprobs=bool(logprobs))
            message.changes.append(AddRequest(request_id, prompt, params, dp_rank))
        elif kind in (ABORT, STOPPED):
            message.changes.append((kind, values[at + 1]))
            at += 2
        else:
            raise RuntimeError(f"the step message from rank 0 holds an unknown change kind {kind}")
    return message


def schedule_digest(chunks) -> int:
    """A 63-bit digest of a step's schedule: its (request id, token count) pairs in order."""
    text = ",".join(f"{request.request_id}:{count}" for request, count in chunks).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class StepBroadcast:
    """Rank 0's side (:meth:`record`, :meth:`send`) and the other ranks' side (:meth:`receive`) of the
    per-step message, over the world group, on ``device`` (the model's: NCCL broadcasts device tensors)."""

    def __init__(self, device):
        self.group = dist.group.WORLD
        self.is_source = dist.get_rank() == 0
        self.device = device
        self.changes: list = []
        self.last_digest = 0                          # of this rank's last step

    def record(self, change) -> None:
        """Rank 0: remember a change for the next message."""
        if self.is_source:
            self.changes.append(change)

    def send(self, shutdown: bool = False) -> None:
        message = StepMessage(self.changes, self.last_digest, shutdown)
        self.changes = []
        values = torch.tensor(encode(message), dtype=torch.int64, device=self.device)
        comms.broadcast_(torch.tensor([values.numel()], dtype=torch.int64, device=self.device), 0, self.group)
        comms.broadcast_(values, 0, self.group)

    def receive(self) -> StepMessage:
        length = comms.broadcast_(torch.zeros(1, dtype=torch.int64, device=self.device), 0, self.group)
        values = comms.broadcast_(torch.zeros(int(length.item()), dtype=torch.int64, device=self.device), 0,
                                  self.group)
        message = decode(values.cpu().tolist())
        if message.previous_digest != self.last_digest:
            raise RuntimeError(f"rank {dist.get_rank()} ran another schedule than rank 0 in the last step (digest "
                               f"{self.last_digest:#x}, rank 0's {message.previous_digest:#x}): the ranks' engines "
                               "diverged (a different model, EngineConfig or KV pool); every rank must serve the "
                               "same checkpoint with the same settings")
        return message


def agree_num_blocks(num_blocks: int, device) -> int:
    """The fewest KV blocks any rank's memory holds (ranks of other pipeline stages or TP shards size theirs
    differently): the pool size every rank's scheduler uses, so that they schedule alike."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return num_blocks
    count = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    return int(comms.all_reduce_(count, dist.group.WORLD, op=dist.ReduceOp.MIN).item())
