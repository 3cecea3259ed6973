"""The NVSHMEM symmetric heap without a GPU: what can be checked on the CPU.

A fake nvshmem4py (``nvshmem.core`` + its torch interop, ``cuda.core``) is injected into
``sys.modules``, recording every call; CUDA queries are patched in the module. Checked: NVSHMEM is
initialised once per process and finalised when the last heap closes (two heaps of one EP group share
it; a new one after that initialises again); a heap of another EP group is refused; the symmetric size
is set from the first reservation before init, or a preset size is checked, with errors naming the
bytes needed and available; barriers pass a stream object (CUDA stream protocol), never None;
``cuda.core`` is found under both import paths; the real module without a GPU fails with a clear
message. The real thing runs in ``benchmarks/gpu_check.py`` (part ``nvshmem``) on a GPU.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from moe_compile.errors import RuntimeFault
from moe_compile.runtime.symmetric import nvshmem as nv


class FakeDist:
    """The torch.distributed calls the heap makes, for one rank of an EP group of ``ranks``."""

    def __init__(self, ranks=(0,), rank=0):
        self.ranks, self.rank = tuple(ranks), rank
        self.broadcasts = 0

    def get_rank(self, group):
        return self.rank

    def get_world_size(self, group):
        return len(self.ranks)

    def get_process_group_ranks(self, group):
        return list(self.ranks)

    def broadcast_object_list(self, objs, group_src=0, group=None):
        self.broadcasts += 1


class FakeStream:
    cuda_stream = 0x1234

    def synchronize(self):
        pass


def fake_nvshmem(log: list):
    """Modules nvshmem, nvshmem.core, nvshmem.core.interop(.torch), cuda, cuda.core: the nvshmem4py
    0.4 surface the heap uses, recording calls in ``log``."""
    core = types.ModuleType("nvshmem.core")

    class NvshmemStream:
        def __init__(self, pt_stream):
            self.pt_stream = pt_stream

        def __cuda_stream__(self):
            return (0, self.pt_stream.cuda_stream)

    def init(device=None, uid=None, rank=None, nranks=None, initializer_method=""):
        import os

        log.append(("init", rank, nranks, initializer_method, os.environ.get(nv.SIZE_ENV)))

    def barrier_all(stream=None):
        if stream is None:
            raise ValueError("Stream may not be None for barrier_all")  # as nvshmem4py's NvshmemInvalid
        log.append(("barrier_all", stream.__cuda_stream__()))

    core.NvshmemStream = NvshmemStream
    core.init = init
    core.finalize = lambda: log.append(("finalize",))
    core.get_unique_id = lambda empty=False: "uid"
    core.barrier_all = barrier_all
    interop = types.ModuleType("nvshmem.core.interop")
    nvt = types.ModuleType("nvshmem.core.interop.torch")
    nvt.tensor = lambda shape, dtype=torch.float32: (log.append(("tensor", shape)), torch.empty(shape, dtype=dtype))[1]
    nvt.get_peer_tensor = lambda t, pe: t
    nvt.free_tensor = lambda t: log.append(("free", tuple(t.shape)))
    interop.torch = nvt
    core.interop = interop
    top = types.ModuleType("nvshmem")
    top.core = core
    cuda, cuda_core = types.ModuleType("cuda"), types.ModuleType("cuda.core")

    class Device:
        def __init__(self, i):
            self.i = i

        def set_current(self):
            log.append(("set_current", self.i))

    cuda_core.Device = Device
    cuda.core = cuda_core
    return {"nvshmem": top, "nvshmem.core": core, "nvshmem.core.interop": interop,
            "nvshmem.core.interop.torch": nvt, "cuda": cuda, "cuda.core": cuda_core}


@pytest.fixture
def fake(monkeypatch):
    log: list = []
    for name, mod in fake_nvshmem(log).items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(nv, "_cuda_available", lambda: True)
    monkeypatch.setattr(nv, "_current_device", lambda: 0)
    monkeypatch.setattr(nv, "_current_stream", lambda: FakeStream())
    monkeypatch.setattr(nv, "RUNTIME", nv._Runtime())
    monkeypatch.setattr(nv, "dist", FakeDist())
    monkeypatch.setenv(nv.SIZE_ENV, "unset")  # restored (removed) after the test, whatever the heap sets
    monkeypatch.delenv(nv.SIZE_ENV)
    return log


def _kinds(log):
    return [e[0] for e in log]


def test_init_and_finalize_are_reference_counted(fake):
    a, b = nv.NvshmemHeap(None), nv.NvshmemHeap(None)  # two compiled models in one process
    assert _kinds(fake) == []  # nothing initialised at compile time: heaps join at first use
    a.reserve(3 << 20)
    buf = a.alloc("lease@0", (2, 1024), torch.uint8)
    b.alloc("lease@0", (4, 256), torch.float32)
    assert _kinds(fake).count("init") == 1 and nv.RUNTIME.refs == 2
    assert buf.local.shape == (2, 1024) and a.allocated_bytes == 2048 and nv.RUNTIME.allocated == 2048 + 4096
    a.barrier()
    assert fake[-1] == ("barrier_all", (0, FakeStream.cuda_stream))  # torch's stream, wrapped; never None
    a.close()
    assert "finalize" not in _kinds(fake) and nv.RUNTIME.refs == 1  # b still uses NVSHMEM
    a.close()  # idempotent
    assert nv.RUNTIME.refs == 1
    b.close()
    assert _kinds(fake).count("finalize") == 1 and nv.RUNTIME.refs == 0
    assert _kinds(fake).count("free") == 2
    c = nv.NvshmemHeap(None)  # after the last close, a new heap initialises NVSHMEM again
    c.alloc("x", (8,), torch.int64)
    assert _kinds(fake).count("init") == 2
    c.close()
    assert _kinds(fake).count("finalize") == 2
    with pytest.raises(RuntimeFault, match="after close"):
        c.alloc("y", (1,), torch.uint8)


def test_heap_size_is_set_from_the_reservation_before_init(fake):
    h = nv.NvshmemHeap(None)
    need = 3 << 30  # a lease plan larger than NVSHMEM's 1 GiB default
    h.reserve(need)
    init = next(e for e in fake if e[0] == "init")
    assert init[1:4] == (0, 1, "uid")
    assert int(init[4]) == nv.heap_size_for(need) >= need  # NVSHMEM_SYMMETRIC_SIZE at the moment of init
    h.close()
    import os

    assert nv.SIZE_ENV not in os.environ  # what the heap set goes with the runtime


def test_preset_heap_size_is_checked_with_needed_and_available_bytes(fake, monkeypatch):
    monkeypatch.setenv(nv.SIZE_ENV, "1M")
    h = nv.NvshmemHeap(None)
    with pytest.raises(RuntimeFault, match=r"needs 2097152 bytes, but only 1048576 bytes are available"):
        h.reserve(2 << 20)
    assert "init" not in _kinds(fake)  # refused before NVSHMEM started
    h.reserve(512 << 10)
    h.alloc("a", (512 << 10,), torch.uint8)
    with pytest.raises(RuntimeFault, match=r"needs 1048576 bytes, but only 524288 bytes are available.*"
                                           r"NVSHMEM_SYMMETRIC_SIZE is set to 1048576"):
        h.alloc("b", (1 << 20,), torch.uint8)  # cannot grow after init
    g = nv.NvshmemHeap(None)  # a second model sharing the runtime is checked against what is left
    with pytest.raises(RuntimeFault, match=r"a lease plan's pools needs 600000 bytes, but only 524288"):
        g.reserve(600_000)
    g.close()
    h.close()
    assert _kinds(fake).count("finalize") == 1


def test_transport_round_trip_on_the_heap(fake):
    """The symmetric transport over the (fake) NVSHMEM heap, one PE: dispatch → combine returns every
    row; the counts exchange writes the peer matrix by slice (no CPU index into device tensors) and
    every barrier hands nvshmem4py a stream."""
    import importlib.util
    import os

    import moe_compile  # noqa: F401  (registers the moe:: ops)
    from moe_compile.runtime import RuntimeContext, RuntimeStats, register_context, release_context
    from moe_compile.runtime.lease_runtime import LeaseRuntime
    from moe_compile.runtime.symmetric_transport import SymmetricTransport

    spec = importlib.util.spec_from_file_location(
        "bench_transport", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "transport.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tokens, d, experts, top_k = 40, 32, 4, 2
    rows = tokens * top_k
    heap = nv.NvshmemHeap(None)
    plan = bench._plan(1, experts, rows, rows, d)
    heap.reserve(plan.symmetric_bytes)
    leases = LeaseRuntime(heap, None)
    stats = RuntimeStats()
    ctx = register_context(RuntimeContext(SymmetricTransport(heap, leases, stats), stats, leases=leases))
    try:
        leases.activate(leases.install(plan))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, d, generator=g)
        idx = torch.randint(0, experts, (tokens, top_k), generator=g)
        xs, _order, counts = torch.ops.moe.permute(x, idx, experts, "bench")
        recv, recv_counts, layout = torch.ops.moe.dispatch(xs, counts, ctx, "bench", rows, 1)
        assert torch.equal(recv[:rows], xs) and torch.equal(recv_counts, counts)
        assert torch.equal(layout[0, 0, 0], counts)  # the exchanged requested-count row
        back = torch.ops.moe.combine(recv, layout, ctx, "bench", rows)
        torch.ops.moe.lease_release(ctx, "bench/dispatch.recv", back)
        assert torch.equal(back, xs)
    finally:
        release_context(ctx)
        heap.close()
    barriers = [e for e in fake if e[0] == "barrier_all"]
    assert len(barriers) >= 4 and all(e[1] == (0, FakeStream.cuda_stream) for e in barriers)
    assert _kinds(fake).count("init") == _kinds(fake).count("finalize") == 1


def test_parse_size():
    assert nv.parse_size("1073741824") == 1 << 30
    assert nv.parse_size("1G") == nv.parse_size("1g") == nv.parse_size("1GB") == 1 << 30
    assert nv.parse_size("512M") == 512 << 20 and nv.parse_size("1.5k") == 1536
    with pytest.raises(RuntimeFault, match="not a size"):
        nv.parse_size("lots")


def test_a_second_ep_group_is_refused(fake, monkeypatch):
    monkeypatch.setattr(nv, "dist", FakeDist(ranks=(0, 1), rank=0))
    a = nv.NvshmemHeap(None)
    a.alloc("x", (4,), torch.uint8)
    monkeypatch.setattr(nv, "dist", FakeDist(ranks=(0, 2), rank=0))
    b = nv.NvshmemHeap(None)
    with pytest.raises(RuntimeFault, match=r"global ranks \[0, 1\]; this heap's EP group has ranks \[0, 2\]"):
        b.alloc("x", (4,), torch.uint8)
    b.close()
    a.close()
    assert _kinds(fake).count("init") == _kinds(fake).count("finalize") == 1


def test_stream_without_nvshmem_stream_class(fake):
    core = sys.modules["nvshmem.core"]
    del core.NvshmemStream  # an nvshmem4py without the wrapper: the protocol adapter stands in
    assert nv.nvshmem_stream(core, FakeStream()).__cuda_stream__() == (0, FakeStream.cuda_stream)


def test_cuda_core_import_paths(monkeypatch):
    new, old = types.ModuleType("cuda.core"), types.ModuleType("cuda.core.experimental")
    new.Device, old.Device = "new", "old"
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.core", new)
    monkeypatch.setitem(sys.modules, "cuda.core.experimental", old)
    assert nv.cuda_core_device() == "new"  # current cuda-python: cuda.core
    del new.Device
    assert nv.cuda_core_device() == "old"  # older releases: cuda.core.experimental only
    monkeypatch.setitem(sys.modules, "cuda.core.experimental", types.ModuleType("cuda.core.experimental"))
    with pytest.raises(ImportError, match=r"neither cuda.core .* nor cuda.core.experimental"):
        nv.cuda_core_device()


def test_missing_nvshmem4py_is_named(monkeypatch):
    monkeypatch.setattr(nv, "_cuda_available", lambda: True)
    monkeypatch.setitem(sys.modules, "nvshmem", None)  # import fails
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(RuntimeFault, match="needs nvshmem4py"):
        nv.NvshmemHeap(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_the_heap_fails_clearly():
    with pytest.raises(RuntimeFault, match="needs a CUDA device; this process has none"):
        nv.NvshmemHeap(None)
