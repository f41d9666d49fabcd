"""The byte half of vLLM PD mode: a prefill process hands KV blocks to a decode process.

Engine-neutral (no vLLM import): ``pd.py`` turns vLLM's KV cache tensors into ``CacheLayer`` s and
drives the two agents. The producer (``PDSender``, prefill side) holds the blocks of each finished
prefill (``hold``) until the consumer's ``TransferRequest`` for it arrived and its bytes were
written, or until ``hold_s`` passed; the consumer (``PDReceiver``, decode side) asks for a request's
blocks, naming where each block position must land in its own cache, and learns the outcome.

Wire. Control frames are hybridkv's transfer messages (``Hello``, ``TransferRequest``, ``Status``)
in hybridkv's authenticated frames (``auth.Seal`` / ``auth.Gate``: cluster key MAC, addressee,
no replays) over zmq (the sender binds a ROUTER at ``tcp://host:port``; each receiver connects
a DEALER). Bytes move with hybridkv's Mooncake transfer engine transport (``transfer.transport``,
TCP): the sender writes each block straight from its own registered KV tensors into the
receiver's registered KV tensors. (The shm transport cannot serve here: it writes only into a
``/dev/shm`` arena the receiver allocated, and vLLM allocates its own KV tensors.)

Layouts. Each side publishes a ``BufferSet`` of its caches: one entry per (layer, leading index:
``k``/``v``) with the block's address, stride, bytes, dtype, shape, block size (page size) and
pool (``full`` or ``swa:<window>``), keyed by the global layer id (parsed from the layer name).
``pairing.pair_entries`` pairs the receiver's entries with the sender's by global layer id and
checks dtype, block size, pool, tensor and shape of every pair before any byte moves: a
mismatch refuses the request with an error naming both sides.

Invariants:
- A frame is read only after ``Gate.open`` accepted it (MAC, addressee, sequence); a refused
  frame is counted and changes nothing.
- Source addresses come only from this sender's own layout and the block ids its engine held for
  that request (``hold``): a receiver names only a request id and destination block ids; every id
  is checked against its entry's block count on both sides, and the destination entry lies in a
  region the receiver registered (``BufferSet`` checks it; Mooncake refuses writes outside).
- A request is sent at most once: after its write (done or failed) or its ``hold_s`` its blocks
  are released (``finished``) and a later request for it is refused.
- A ``Status`` counts only with the request id and the nonce the receiver sent; a transfer that
  failed, was refused, or got no answer within ``wait_s`` is reported failed, never done.
"""

from __future__ import annotations

import logging
import math
import queue
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import zmq

from hybridkv.spec import dtype_name
from hybridkv.transfer.agent import check_endpoint
from hybridkv.transfer.auth import ClusterKey, Gate, Seal
from hybridkv.transfer.buffers import BufferEntry, BufferSet
from hybridkv.transfer.errors import ProtocolError, TransferError, TransportError
from hybridkv.transfer.messages import Hello, Rank, Status, TransferRequest
from hybridkv.transfer.pairing import EntryPair, pair_entries
from hybridkv.transfer.status import LegStatus
from hybridkv.transfer.transport import Transport, TransportName

log = logging.getLogger("hybridkv.vllm.pd")

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
NULL = -1
"""A block position not sent (decode side: a null block; prefill side: a block it no longer holds)."""
POLL_MS = 20
ERRORS_KEPT = 100
"""The last errors a sender or receiver keeps for its report."""


@dataclass(frozen=True)
class CacheLayer:
    """One vLLM cache tensor of one layer: ``tensor.select(block_dim, b)`` is block ``b``."""

    name: str
    group: int
    tensor: torch.Tensor
    block_dim: int
    pool: str
    block_size: int
    part: str = ""
    """Which of the layer's cache tensors (a recurrent layer has several: ``s0``, ``s1`` ...)."""


def layer_id(name: str) -> int:
    """The global layer id in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if not found:
        raise TransferError(f"layer {name!r}: no layer index in its name; PD mode pairs layers by global layer id")
    return int(found[-1])


def group_key(layer_ids: Sequence[int]) -> str:
    """How a ``TransferRequest`` names a KV cache group: by the global ids of its layers."""
    return "layers:" + ",".join(str(i) for i in sorted(set(layer_ids)))


def build_layout(model: str, layers: Sequence[CacheLayer]) -> tuple[BufferSet, list[int]]:
    """The ``BufferSet`` of ``layers`` and the group of each entry. A tensor whose blocks are not
    contiguous runs of bytes is refused (``TransferError``)."""
    entries: list[BufferEntry] = []
    ids: list[int] = []
    groups: list[int] = []
    regions: dict[int, int] = {}
    for layer in layers:
        t = layer.tensor
        if t.device.type != "cpu":
            raise TransferError(f"layer {layer.name}: PD mode moves host (cpu) caches, this one is on {t.device}")
        lid = layer_id(layer.name)
        storage = t.untyped_storage()
        regions[storage.data_ptr()] = max(regions.get(storage.data_ptr(), 0), storage.nbytes())
        lead = list(t.shape[: layer.block_dim])
        names = [layer.part + n for n in (["k", "v"] if lead == [2] else [f"t{i}" for i in range(math.prod(lead))])]
        flat = t.view(-1, *t.shape[layer.block_dim :]) if lead else t.unsqueeze(0)  # a view: never a copy
        for i, tensor_name in enumerate(names):
            part = flat[i]
            block = part[0]
            if not block.is_contiguous():
                raise TransferError(
                    f"layer {layer.name}: a block of its cache (shape {tuple(t.shape)}, strides {t.stride()}) is not "
                    "contiguous; PD mode moves whole blocks"
                )
            item = block.numel() * t.element_size()
            entries.append(
                BufferEntry(
                    addr=part.data_ptr(),
                    item_len=item,
                    stride=part.stride(0) * t.element_size(),
                    count=part.shape[0],
                    tensor=tensor_name,
                    pool=layer.pool,
                    dtype=dtype_name(t.dtype),
                    shape=tuple(int(d) for d in block.shape),
                    page_size=layer.block_size,
                )
            )
            ids.append(lid)
            groups.append(layer.group)
    top = max(ids, default=0) + 1
    bufs = BufferSet(
        model=model,
        pp_rank=0,
        pp_size=1,
        tp_rank=0,
        tp_size=1,
        layer_range=(0, top),
        entries=tuple(entries),
        layer_ids=tuple(ids),
        regions=tuple(regions.items()),
    )
    return bufs, groups


def build_ops(
    src: BufferSet,
    src_groups: Sequence[int],
    dst: BufferSet,
    pairs: Sequence[EntryPair],
    held: Sequence[Sequence[int]],
    wanted: dict[int, list[int]],
) -> tuple[list[int], list[int], list[int]]:
    """``(src, dst, length)`` ops of one request: for every pair, every block position the receiver
    wants (``wanted[group]``, per position a destination block id or ``NULL``), from the block the
    sender ``held`` there. ``TransferError`` (nothing moves) for a position the sender does not hold
    or an id outside an entry."""
    s_ops: list[int] = []
    d_ops: list[int] = []
    n_ops: list[int] = []
    for pair in pairs:
        a, b = src.entries[pair.src], dst.entries[pair.dst]
        group = src_groups[pair.src]
        if a.item_len != b.item_len:
            raise TransferError(
                f"layer {pair.layer_id}: prefill block of {a.item_len} B, decode block of {b.item_len} B"
            )
        have = held[group]
        for pos, d in enumerate(wanted.get(group, ())):
            if d == NULL:
                continue
            s = have[pos] if pos < len(have) else NULL
            if s == NULL:
                raise TransferError(
                    f"decode wants block position {pos} of group {group} (layer {pair.layer_id}), which prefill "
                    f"does not hold (it holds {sum(x != NULL for x in have)} of {len(have)} positions)"
                )
            if not (0 <= s < a.count and 0 <= d < b.count):
                raise TransferError(
                    f"layer {pair.layer_id}: block id prefill {s} (of {a.count}) / decode {d} (of {b.count}) "
                    "out of range"
                )
            s_ops.append(a.addr + s * a.stride)
            d_ops.append(b.addr + d * b.stride)
            n_ops.append(a.item_len)
    return s_ops, d_ops, n_ops


def _regions(bufs: BufferSet) -> list[tuple[int, int]]:
    return [(int(a), int(n)) for a, n in bufs.regions]


@dataclass
class _Hold:
    blocks: list[list[int]]
    """Per group, per block position, the block id (``NULL`` where not held)."""
    until: float


@dataclass
class _Peer:
    session: str
    buffers: BufferSet
    pairs: tuple[EntryPair, ...] = ()
    refused: str = ""


@dataclass
class SenderStats:
    sent: int = 0
    failed: int = 0
    expired: int = 0
    refused_frames: int = 0
    ops: int = 0
    bytes: int = 0
    seconds: float = 0.0
    errors: deque[str] = field(default_factory=lambda: deque(maxlen=ERRORS_KEPT))


class PDSender:
    """Prefill side: answers ``TransferRequest`` s for the requests its engine holds (see module)."""

    def __init__(
        self,
        engine: str,
        bufs: BufferSet,
        groups: Sequence[int],
        transport: Transport,
        endpoint: str,
        key: ClusterKey,
        hold_s: float = 60.0,
    ) -> None:
        check_endpoint(endpoint)
        self.rank = Rank(engine, 0, 0)
        self.bufs, self.groups = bufs, list(groups)
        self.group_keys = _group_keys(bufs, self.groups)
        self.transport = transport
        for addr, n in _regions(bufs):
            transport.register(addr, n)
        self.hold_s = hold_s
        self.seal, self.gate = Seal(key, self.rank), Gate(key)
        self.stats = SenderStats()
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._finished: set[str] = set()
        self._gone: OrderedDict[str, str] = OrderedDict()  # request id -> how it ended (bounded)
        self._peers: dict[Rank, _Peer] = {}
        self._waiting: list[tuple[bytes, Rank, TransferRequest, float]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            transport.close()
            raise TransferError(
                f"the prefill sender cannot listen on {endpoint} ({exc}); pick a free pd_port"
            ) from None
        self.endpoint = endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hybridkv-pd-send-{engine}", daemon=True)
        self._thread.start()

    # ---- the engine's thread --------------------------------------------------------------------

    def hold(self, request_id: str, blocks: list[list[int]]) -> None:
        """Keep ``blocks`` (per group, per position; ``NULL`` where not held) of ``request_id`` for a
        receiver, until it took them or ``hold_s`` passed."""
        with self._lock:
            self._holds[request_id] = _Hold(blocks, time.monotonic() + self.hold_s)

    def finished(self) -> set[str]:
        """Requests whose blocks the engine may free now (sent, failed, refused or expired)."""
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, h in self._holds.items() if h.until <= now]:
                del self._holds[rid]
                self._finished.add(rid)
                self._remember(rid, f"its hold of {self.hold_s:g} s expired")
                self.stats.expired += 1
                log.warning(
                    "hybridkv PD: no decode took request %s within %g s; its blocks are freed", rid, self.hold_s
                )
            out, self._finished = self._finished, set()
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close(0)
        self._ctx.term()
        self.transport.close()

    # ---- the I/O thread -------------------------------------------------------------------------

    def _remember(self, rid: str, how: str) -> None:
        self._gone[rid] = how
        while len(self._gone) > 4096:
            self._gone.popitem(last=False)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(POLL_MS):
                while True:
                    try:
                        ident, frame = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:  # not two parts: not ours
                        self.stats.refused_frames += 1
                        continue
                    try:
                        self._on_frame(ident, frame)
                    except Exception as exc:  # no input stops this thread
                        self.stats.refused_frames += 1
                        log.warning("hybridkv PD: refused a frame: %s", exc)
            self._serve_waiting()

    def _on_frame(self, ident: bytes, frame: bytes) -> None:
        env = self.gate.open(frame, str(self.rank))
        msg = env.body
        if isinstance(msg, Hello):
            if msg.rank != env.sender:
                raise ProtocolError(f"Hello names rank {msg.rank}, its frame comes from {env.sender}")
            self.transport.check_session(msg.session)
            peer = _Peer(msg.session, msg.buffers)
            try:
                peer.pairs = pair_entries(self.bufs, msg.buffers)
            except TransferError as exc:
                peer.refused = str(exc)
                log.warning("hybridkv PD: decode %s refused: %s", msg.rank, exc)
            self._peers[env.sender] = peer
        elif isinstance(msg, TransferRequest):
            if msg.rank != env.sender:
                raise ProtocolError(f"request names rank {msg.rank}, its frame comes from {env.sender}")
            self._waiting.append((ident, env.sender, msg, time.monotonic() + max(0.0, min(msg.ttl_s, 600.0))))
        else:
            raise ProtocolError(f"a prefill sender takes Hello and TransferRequest, not {type(msg).__name__}")

    def _serve_waiting(self) -> None:
        now = time.monotonic()
        keep = []
        for ident, sender, req, deadline in self._waiting:
            with self._lock:
                hold = self._holds.pop(req.request_id, None)
                gone = self._gone.get(req.request_id)
            if hold is None and gone is None and now < deadline:
                keep.append((ident, sender, req, deadline))  # its prefill has not finished here yet
                continue
            if hold is None:
                why = gone and f"request {req.request_id} is no longer held by prefill {self.rank}: {gone}"
                self._reply(
                    ident,
                    sender,
                    req,
                    LegStatus.FAILED,
                    why or f"prefill {self.rank} holds no request {req.request_id}",
                )
                continue
            self._send(ident, sender, req, hold)
        self._waiting = keep

    def _send(self, ident: bytes, sender: Rank, req: TransferRequest, hold: _Hold) -> None:
        started = time.perf_counter()
        ops, nbytes = 0, 0
        try:
            peer = self._peers.get(sender)
            if peer is None:
                raise TransferError(f"decode {sender} sent no Hello (no layout to pair with)")
            if peer.refused:
                raise TransferError(peer.refused)
            wanted: dict[int, list[int]] = {}
            for name, ids in req.dst_cells.items():
                group = self.group_keys.get(name)
                if group is None:
                    raise TransferError(
                        f"decode {sender} names KV cache group {name!r}; prefill {self.rank} has groups "
                        f"{sorted(self.group_keys)}: run both with the same model and KV cache grouping"
                    )
                wanted[group] = [int(i) for i in ids]
            src, dst, length = build_ops(self.bufs, self.groups, peer.buffers, peer.pairs, hold.blocks, wanted)
            step = self.transport.max_ops_per_submit
            for i in range(0, len(src), step):
                self.transport.write(peer.session, src[i : i + step], dst[i : i + step], length[i : i + step])
            ops, nbytes = len(src), sum(length)
        except (TransferError, TransportError) as exc:
            self.stats.failed += 1
            self.stats.errors.append(str(exc)[:500])
            log.warning("hybridkv PD: request %s not sent to %s: %s", req.request_id, sender, exc)
            self._release(req.request_id, f"its transfer failed: {exc}")
            self._reply(ident, sender, req, LegStatus.FAILED, str(exc))
            return
        self.stats.sent += 1
        self.stats.ops += ops
        self.stats.bytes += nbytes
        self.stats.seconds += time.perf_counter() - started
        self._release(req.request_id, "it was sent")
        self._reply(ident, sender, req, LegStatus.SUCCESS, "", ops, nbytes)

    def _release(self, rid: str, how: str) -> None:
        with self._lock:
            self._finished.add(rid)
            self._remember(rid, how)

    def _reply(
        self, ident: bytes, to: Rank, req: TransferRequest, phase: LegStatus, reason: str, ops: int = 0, nbytes: int = 0
    ) -> None:
        msg = Status(req.request_id, req.nonce, self.rank, phase, reason, ops, nbytes)
        try:
            self._sock.send_multipart([ident, self.seal.seal(str(to), msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the receiver's wait ends it failed
            log.warning("hybridkv PD: status of %s to %s not sent: %s", req.request_id, to, exc)


def _group_keys(bufs: BufferSet, groups: Sequence[int]) -> dict[str, int]:
    ids: dict[int, list[int]] = {}
    for lid, g in zip(bufs.layer_ids, groups, strict=True):
        ids.setdefault(g, []).append(lid)
    return {group_key(v): g for g, v in ids.items()}


@dataclass(frozen=True)
class Load:
    """One request a receiver asks a sender for."""

    request_id: str
    """The receiver's request id (what it reports done or failed)."""
    remote_request_id: str
    remote_engine: str
    endpoint: str
    blocks: dict[int, list[int]]
    """Per group, per block position, the destination block id (``NULL``: not sent). Empty: only
    tell the sender it may free the request's blocks."""
    error: str = ""
    """Why this load cannot be served (the receiver releases the sender's blocks and reports it failed)."""


@dataclass
class ReceiverStats:
    loaded: int = 0
    failed: int = 0
    ops: int = 0
    bytes: int = 0
    seconds: float = 0.0
    errors: deque[str] = field(default_factory=lambda: deque(maxlen=ERRORS_KEPT))


class PDReceiver:
    """Decode side: asks senders for requests' blocks on a thread of its own (see module)."""

    def __init__(
        self,
        engine: str,
        bufs: BufferSet,
        groups: Sequence[int],
        transport: Transport,
        key: ClusterKey,
        wait_s: float = 30.0,
    ) -> None:
        self.rank = Rank(engine, 0, 0)
        self.bufs, self.groups = bufs, list(groups)
        self.group_keys = {g: k for k, g in _group_keys(bufs, self.groups).items()}
        self.transport = transport
        for addr, n in _regions(bufs):
            transport.register(addr, n)
        self.wait_s = wait_s
        self.seal, self.gate = Seal(key, self.rank), Gate(key)
        self.stats = ReceiverStats()
        self._jobs: queue.SimpleQueue[Load | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._ctx = zmq.Context()
        self._socks: dict[tuple[str, str], zmq.Socket] = {}
        """Per (endpoint, engine id): a new prefill engine on the same endpoint gets a new socket and Hello."""
        self._thread = threading.Thread(target=self._run, name=f"hybridkv-pd-recv-{engine}", daemon=True)
        self._thread.start()

    def submit(self, load: Load) -> None:
        self._jobs.put(load)

    def results(self) -> tuple[set[str], set[str]]:
        """(requests whose blocks landed, requests whose load failed) since the last call."""
        with self._lock:
            done, self._done = self._done, set()
            failed, self._failed = self._failed, set()
        return done, failed

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(self.wait_s + 5.0)
        for sock in self._socks.values():
            sock.close(0)
        self._ctx.term()
        self.transport.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            started = time.perf_counter()
            try:
                status = self._load(job)
                if job.error:  # the sender was only told to free the blocks
                    status = Status(job.remote_request_id, 0, self.rank, LegStatus.FAILED, job.error)
                ok = status.phase is LegStatus.SUCCESS
                why = status.reason
            except Exception as exc:  # a load never ends done by mistake
                ok, why, status = False, f"{type(exc).__name__}: {exc}", None
            if not job.blocks and not job.error:
                continue  # a release: nothing was to land
            with self._lock:
                (self._done if ok else self._failed).add(job.request_id)
            if ok and status is not None:
                self.stats.loaded += 1
                self.stats.ops += status.ops
                self.stats.bytes += status.nbytes
                self.stats.seconds += time.perf_counter() - started
            else:
                self.stats.failed += 1
                self.stats.errors.append(why[:500])
                log.warning("hybridkv PD: request %s not loaded (vLLM recomputes it): %s", job.request_id, why)

    def _sock(self, endpoint: str, engine: str) -> zmq.Socket:
        sock = self._socks.get((endpoint, engine))
        if sock is None:
            check_endpoint(endpoint)
            sock = self._socks[(endpoint, engine)] = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(endpoint)
            hello = Hello(self.rank, "", TransportName(self.transport.name), self.transport.session, self.bufs)
            sock.send(self.seal.seal(str(Rank(engine, 0, 0)), hello))
        return sock

    def _load(self, job: Load) -> Status:
        sock = self._sock(job.endpoint, job.remote_engine)
        nonce = secrets.randbits(63)
        cells = {self.group_keys[g]: ids for g, ids in job.blocks.items()}
        req = TransferRequest(job.remote_request_id, nonce, self.rank, 0, cells, self.wait_s, False)
        sock.send(self.seal.seal(str(Rank(job.remote_engine, 0, 0)), req))
        deadline = time.monotonic() + self.wait_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            try:
                env = self.gate.open(sock.recv(), str(self.rank))
            except ProtocolError as exc:
                log.warning("hybridkv PD: refused a frame from %s: %s", job.endpoint, exc)
                continue
            msg = env.body
            if isinstance(msg, Status) and msg.request_id == job.remote_request_id and msg.nonce == nonce:
                if msg.rank != env.sender or env.sender.engine != job.remote_engine:
                    raise ProtocolError(f"status of {job.remote_request_id} from {env.sender}, not the prefill asked")
                return msg
        return Status(
            job.remote_request_id,
            nonce,
            self.rank,
            LegStatus.FAILED,
            f"no answer from prefill {job.remote_engine} at {job.endpoint} within {self.wait_s:g} s",
        )
