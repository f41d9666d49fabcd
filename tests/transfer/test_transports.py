"""Transports copy exactly the ops given and refuse ranges or memory they must not touch."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridkv.memory import UnifiedMemory
from hybridkv.native_log import init_log
from hybridkv.spec import ShardSpec, get_preset
from hybridkv.transfer import (
    TRANSPORTS,
    DecodeReceiver,
    PrefillSender,
    SharedBuffer,
    TransferError,
    TransportError,
    TransportName,
    make_transport,
)
from hybridkv.transfer.ops import Bounds
from hybridkv.transfer.transport import Completion, WriteStatus, transport_class


def test_shm_copies_big_and_small_ops_and_refuses_foreign_ranges():
    peer = SharedBuffer(1 << 16)
    receiver = make_transport("shm", peer)
    writer = make_transport("shm")
    src = torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8)
    base = src.data_ptr()
    writer.register(base, src.numel())
    src_off = np.array([0, 5000, 100, 7], dtype=np.int64)
    dst_off = np.array([8192, 0, 40000, 60000], dtype=np.int64)
    length = np.array([4096, 3000, 37, 1], dtype=np.int64)  # two memmoves, two vectorized
    writer.write(receiver.session, base + src_off, peer.addr + dst_off, length)
    got, want = peer.tensor.numpy(), src.numpy()
    for s, d, n in zip(src_off, dst_off, length, strict=True):
        assert np.array_equal(got[d : d + n], want[s : s + n])
    untouched = np.ones(got.size, dtype=bool)
    for d, n in zip(dst_off, length, strict=True):
        untouched[d : d + n] = False
    assert not got[untouched].any()
    before = got.copy()
    with pytest.raises(TransportError, match="outside the peer's buffer"):
        writer.write(receiver.session, base + src_off, peer.addr + dst_off + (1 << 16) - 4096, length)
    with pytest.raises(TransportError, match="outside every registered local region"):
        writer.write(receiver.session, base + src_off + (1 << 16), peer.addr + dst_off, length)
    honest = Bounds(base, base + (1 << 16), peer.addr, peer.addr + (1 << 16), 1)
    with pytest.raises(TransportError, match="outside the peer's buffer"):  # the caller's bounds are checked too
        writer.write(
            receiver.session, base + src_off, peer.addr + dst_off, length, honest._replace(dst_hi=peer.addr + (1 << 17))
        )
    loose = honest._replace(src_lo=base - 1, src_hi=base + (1 << 20))  # not in one region: each op is checked
    with pytest.raises(TransportError, match="outside every registered local region"):
        writer.write(receiver.session, base + src_off + (1 << 16), peer.addr + dst_off, length, loose)
    with pytest.raises(TransportError, match="not a shm session"):
        writer.write("tcp://nope", base + src_off, peer.addr + dst_off, length)
    # big ops as lists with the plan's bounds (a small plan's form: the memmove-only path)
    big_src, big_dst, big_len = [base, base + 8192], [peer.addr + 4096, peer.addr + 20000], [4096, 2048]
    tight = Bounds(base, base + 10240, peer.addr + 4096, peer.addr + 22048, 2048)
    for bad, why in [
        (tight._replace(dst_hi=peer.addr + (1 << 16) + 1), "outside the peer's buffer"),
        (tight._replace(dst_lo=peer.addr - 1), "outside the peer's buffer"),
    ]:
        with pytest.raises(TransportError, match=why):  # bounds past the peer's buffer: refused
            writer.write(receiver.session, big_src, [d + (1 << 16) for d in big_dst], big_len, bad)
    with pytest.raises(TransportError, match="outside every registered local region"):
        far = [s + (1 << 16) for s in big_src]
        writer.write(receiver.session, far, big_dst, big_len, tight._replace(src_hi=base + (1 << 17)))
    assert np.array_equal(got, before)  # refused writes copy nothing
    writer.write(receiver.session, big_src, big_dst, big_len, tight)
    assert np.array_equal(got[4096:8192], want[:4096]) and np.array_equal(got[20000:22048], want[8192:10240])
    writer.close()
    receiver.close()
    peer.close()


def test_agents_refuse_memory_their_transport_cannot_touch():
    meta = UnifiedMemory.create(
        ShardSpec.whole(get_preset("tiny-dense")), "1MiB", device="meta", page_size=4, max_context=64
    )
    link = make_transport("shm")
    for agent in (PrefillSender, DecodeReceiver):
        with pytest.raises(TransferError, match="moves \\['cpu'\\] memory, this memory is on 'meta'"):
            agent(meta, "e", "tcp://127.0.0.1:9", link)


def test_submit_poll_wait_on_both_transports():
    """The asynchronous API: a handle ends once, DONE with every byte landed or FAILED with
    a reason; poll never blocks; wait returns the status it reached."""
    src = torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8)
    src_off = np.array([0, 4096, 9000], dtype=np.int64)
    dst_off = np.array([100, 20000, 50000], dtype=np.int64)
    length = np.array([4096, 2048, 37], dtype=np.int64)
    for name in TRANSPORTS:
        peer = SharedBuffer(1 << 16)
        receiver, writer = make_transport(name, peer), make_transport(name)
        try:
            receiver.register(peer.addr, peer.nbytes)
            writer.register(src.data_ptr(), src.numel())
            handle = writer.submit(receiver.session, src.data_ptr() + src_off, peer.addr + dst_off, length)
            assert writer.poll(handle).completion in (Completion.PENDING, Completion.DONE)
            assert writer.wait(handle, 30) == WriteStatus(Completion.DONE)
            assert writer.poll(handle).ended
            got = peer.tensor.numpy()
            for s, d, n in zip(src_off, dst_off, length, strict=True):
                assert np.array_equal(got[d : d + n], src.numpy()[s : s + n]), name
            with pytest.raises(RuntimeError, match="ended twice"):
                handle.finish(WriteStatus(Completion.FAILED, "late"))
            empty = writer.submit(receiver.session, [], [], [])
            assert writer.poll(empty).completion is Completion.DONE
            peer.tensor.zero_()  # submit_wait: the same write, ended when it returns
            ops = (src.data_ptr() + src_off).tolist(), (peer.addr + dst_off).tolist(), length.tolist()
            assert writer.submit_wait(receiver.session, *ops) == WriteStatus(Completion.DONE)
            for s, d, n in zip(src_off, dst_off, length, strict=True):
                assert np.array_equal(got[d : d + n], src.numpy()[s : s + n]), name
            assert writer.submit_wait(receiver.session, [], [], []).completion is Completion.DONE
            if name is TransportName.MOONCAKE:  # more ops could overflow the peer's queue
                ops = [src.data_ptr()] * (writer.max_ops_per_submit + 1)
                with pytest.raises(TransportError, match="split plans into chunks"):
                    writer.submit(receiver.session, ops, ops, [1] * len(ops))
                with pytest.raises(TransportError, match="split plans into chunks"):
                    writer.submit_wait(receiver.session, ops, ops, [1] * len(ops))
        finally:
            writer.close()
            receiver.close()
            peer.close()


def test_mooncake_failure_ends_the_handle_failed_with_the_reason():
    receiver, writer = make_transport("mooncake"), make_transport("mooncake")
    dst = torch.zeros(4096, dtype=torch.uint8)
    src = torch.ones(4096, dtype=torch.uint8)
    try:
        receiver.register(dst.data_ptr(), dst.numel())
        writer.register(src.data_ptr(), src.numel())
        writer.warm(receiver.session)
        writer.write(receiver.session, [src.data_ptr()], [dst.data_ptr()], [64])  # a warmed peer takes writes
        assert dst[:64].all() and not dst[64:].any()
        dst.zero_()
        outside = dst.data_ptr() + dst.numel()  # past what the peer registered
        handle = writer.submit(receiver.session, [src.data_ptr()], [outside], [64])
        status = writer.wait(handle, 60)
        assert status.completion is Completion.FAILED and "answering probes" in status.reason
        assert writer.poll(handle) == status
        waited = writer.submit_wait(receiver.session, [src.data_ptr()], [outside], [64])  # the same, inline
        assert waited.completion is Completion.FAILED and "answering probes" in waited.reason
        assert not dst.any()
        writer.warm("127.0.0.1:1")  # nobody there: warming says nothing, the write below reports it
        nobody = writer.submit("127.0.0.1:1", [src.data_ptr()], [outside], [64])  # a submit that cannot start
        status = writer.wait(nobody, 60)
        assert status.completion is Completion.FAILED and "127.0.0.1:1" in status.reason
    finally:
        writer.close()
        receiver.close()


def test_mooncake_start_up_noise_is_dropped_and_every_other_stderr_line_kept(capfd):
    refused = "E1130 19:38:37.031479  2009 transfer_metadata_plugin.cpp:1030] SocketHandShakePlugin: refused"
    with init_log() as said:
        os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
        os.write(2, b"E1130 19:38:37.021936  2009 transfer_metadata.cpp:1098] Local segment descriptor not found\n")
        os.write(2, (refused + "\nanother library's line\n").encode())
    assert said == [refused, "another library's line"]
    assert capfd.readouterr().err == f"{refused}\nanother library's line\n"
    # two real engines in a fresh process (glog's warning comes once per process): nothing on stderr
    code = "from hybridkv.transfer import make_transport as m; a, b = m('mooncake'), m('mooncake')"
    code += "; a.close(); b.close()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_registry_names_every_transport_and_refuses_unknown_ones():
    assert set(TRANSPORTS) == set(TransportName)
    for name, cls in TRANSPORTS.items():
        assert cls.name is name and transport_class(name.value) is cls
    with pytest.raises(ValueError, match="unknown transport 'nixl'; known: shm, mooncake"):
        make_transport("nixl")
    with pytest.raises(TypeError, match="takes no options"):
        make_transport("shm", host="127.0.0.1")


def test_product_transfer_code_never_imports_the_testing_package():
    import ast
    import pathlib

    import hybridkv

    root = pathlib.Path(hybridkv.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] in ("testing", "cli"):
            continue  # the CLI's pd-demo runs the testing package's demo
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.startswith("hybridkv.testing")]
    assert offenders == []
