"""The `tpu` device: registration, `torch.tpu`, tensors and transfers, and bad input."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import threading
import textwrap

import pytest
import torch

import torchtpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (device count and locks are per process)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=300)


def test_device_after_import_torch_alone(tmp_path):
    # Its own lock directory: this test process may already hold tpu:0.
    result = _run("""
        import sys
        import torch
        x = torch.ones(2, device="tpu")
        print(torch.device("tpu"), x.device, torch.tpu.is_available(), type(x).__name__,
              "torch._dynamo" in sys.modules)
    """, env={"TORCHTPU_LOCK_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    # Registering the device does not import dynamo (seconds of every `import torch`).
    assert result.stdout.split() == ["tpu", "tpu:0", "True", "Tensor", "False"]


def test_torch_tpu_module():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() == int(os.environ["TORCHTPU_NUM_DEVICES"])
    torch.tpu.set_device(1)
    try:
        assert torch.tpu.current_device() == 1
        assert torch.empty(3, device="tpu").device == torch.device("tpu:1")
    finally:
        torch.tpu.set_device(0)
    with torch.tpu.device(2):
        assert torch.tpu.current_device() == 2
    assert torch.tpu.current_device() == 0
    torch.tpu.synchronize()
    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    assert torch.accelerator.device_count() == torch.tpu.device_count()


def test_backward_on_every_device():
    """The autograd engine has a ready queue per tpu device (the device guard reports them all)."""
    for index in range(torch.tpu.device_count()):
        w = torch.randn(4, 3)
        w_tpu = w.to(f"tpu:{index}").requires_grad_()
        (w_tpu.tanh() * 2).sum().backward()
        w.requires_grad_()
        (w.tanh() * 2).sum().backward()
        assert w_tpu.grad.device == torch.device("tpu", index)
        torch.testing.assert_close(w_tpu.grad.cpu(), w.grad)


def test_backward_runs_on_the_calling_thread():
    """A tpu backward is not handed to an autograd engine thread (see `device.py`)."""
    threads = []
    w = torch.randn(4, 3, device="tpu", requires_grad=True)
    y = w.tanh()
    y.register_hook(lambda grad: threads.append(threading.get_ident()))
    y.sum().backward()
    assert threads == [threading.get_ident()]


def test_memory_stats_follow_live_tensors():
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    x = torch.empty(1024, 256, device="tpu")
    assert torch.tpu.memory_allocated() == before + 1024 * 256 * 4
    assert torch.tpu.max_memory_allocated() >= before + 1024 * 256 * 4
    del x
    assert torch.tpu.memory_allocated() == before


def test_device_name_and_properties_are_the_runtimes():
    import jax

    kind = jax.devices()[1].device_kind  # "cpu" on the stand-in
    assert torch.tpu.get_device_name("tpu:1") == kind
    properties = torch.tpu.get_device_properties(1)
    assert (properties.name, properties.index, properties.platform) == (kind, 1, jax.devices()[1].platform)
    if properties.platform == "cpu":  # device memory is host memory
        with open("/proc/meminfo") as meminfo:
            total_kib = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1])
        assert properties.total_memory == total_kib * 1024
    with pytest.raises(ValueError, match="expected a tpu device"):
        torch.tpu.get_device_name("cpu")


_EMPTY_CACHE = """
import ctypes, time, torch, torchtpu
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096
x = torch.ones(1 << 26, device="tpu")  # 256 MiB, written
x.sum().item()
del x
# The runtime frees a buffer once the program that read it has let go, which may be a moment
# later on its own thread (a CI run measured before it had): wait until the pool holds it.
deadline = time.monotonic() + 30
while libc.mallinfo2().fordblks < 200 << 20 and time.monotonic() < deadline:
    time.sleep(0.01)
kept = resident()
torch.tpu.empty_cache()
print(torchtpu.stand_in_memory.installed(), kept - resident())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in's pool is glibc's")
def test_empty_cache_gives_the_stand_ins_freed_memory_back():
    out = _run(_EMPTY_CACHE, {"TORCHTPU_NUM_DEVICES": "1", "TORCHTPU_DEVICE_LOCK": "0",
                              "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    assert out.returncode == 0, out.stderr
    installed, released = out.stdout.split()
    assert installed == "True"
    assert int(released) > 200 << 20, released  # the freed 256 MiB the pool kept


def test_empty_cache_forgets_the_collectives_pooled_memory():
    from torchtpu.distributed.host_transport import ReceiveBuffers, ResultArrays

    buffers, results = ReceiveBuffers(), ResultArrays()
    buffers.take((1024,), torch.float32)
    for _ in range(3):  # a size is pooled once asked for three times
        results.take(1024, torch.float32, 0)
    assert buffers.pooled_bytes and results.pooled_bytes
    torch.tpu.empty_cache()
    assert buffers.pooled_bytes == 0 and results.pooled_bytes == 0


def test_a_storage_that_pytorch_allocates_on_tpu_holds_device_data():
    # PyTorch asks the PrivateUse1 allocator for it (without one the process crashed).
    raw = torch.UntypedStorage(16, device="tpu:1")
    assert raw.device == torch.device("tpu:1") and raw.nbytes() == 16
    t = torch.empty(0, dtype=torch.int32, device="tpu:1").set_(raw)
    assert t.tolist() == [0, 0, 0, 0]  # fresh device memory reads as zeros
    t.add_(torch.arange(4, dtype=torch.int32, device="tpu:1"))
    assert t.cpu().tolist() == [0, 1, 2, 3]


def test_torch_accelerator_memory_api_counts_tpu_storages():
    torch.tpu.synchronize()
    before = torch.accelerator.memory_allocated(0)
    assert before == torch.tpu.memory_allocated(0)
    x = torch.empty(1024, 256, device="tpu:0")
    assert torch.accelerator.memory_allocated(0) == before + x.nbytes
    torch.accelerator.reset_peak_memory_stats(0)
    assert torch.accelerator.max_memory_allocated(0) == before + x.nbytes
    stats = torch.accelerator.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == stats["reserved_bytes.all.current"] == before + x.nbytes
    del x
    assert torch.accelerator.memory_allocated(0) == before
    free, total = torch.accelerator.get_memory_info(0)
    assert total == torch.tpu.get_device_properties(0).total_memory and 0 < free <= total


def test_torch_tpu_memory_stats_are_torch_cudas_names_for_the_same_counts():
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated(0)
    x = torch.empty(512, 128, device="tpu:0")
    assert torch.tpu.memory_reserved(0) == torch.accelerator.memory_reserved(0) == before + x.nbytes
    torch.tpu.reset_peak_memory_stats(0)
    y = torch.empty(64, device="tpu:0")
    del y
    assert torch.tpu.max_memory_reserved(0) == torch.accelerator.max_memory_reserved(0) == before + x.nbytes + 256
    stats = torch.tpu.memory_stats("tpu:0")
    assert stats.keys() == torch.accelerator.memory_stats(0).keys() and "num_ooms" in stats
    assert stats["allocated_bytes.all.current"] == stats["reserved_bytes.all.current"] == before + x.nbytes
    assert stats["allocated_bytes.all.peak"] == before + x.nbytes + 256
    del x
    assert torch.tpu.memory_reserved(0) == before


def test_torch_tpu_memory_summary_states_the_counts():
    x = torch.empty(1 << 18, device="tpu:0")
    lines = torch.tpu.memory_summary(0).splitlines()
    assert lines[0] == f"tpu:0 ({torch.tpu.get_device_name(0)}) memory"
    stated = {line[:17].strip(): int(line[17:].split(" B")[0].replace(",", "")) for line in lines[1:]}
    assert stated.keys() == {"allocated now", "allocated peak", "reserved now", "reserved peak", "device free",
                             "device total"}
    assert stated["allocated now"] == stated["reserved now"] == torch.tpu.memory_allocated(0) >= x.nbytes
    assert stated["allocated peak"] == torch.tpu.max_memory_allocated(0)
    assert stated["device total"] == torch.tpu.get_device_properties(0).total_memory > stated["device free"] > 0
    assert torch.tpu.memory_summary("tpu:0", abbreviated=True).splitlines()[0] == lines[0]


def test_memory_summary_sizes_read_exactly_and_in_a_binary_unit():
    from torchtpu.device import _bytes

    assert _bytes(100) == "100 B"
    assert _bytes(1536) == "1,536 B (1.5 KiB)"
    assert _bytes(1 << 20) == "1,048,576 B (1.0 MiB)"
    assert _bytes(3 << 40) == "3,298,534,883,328 B (3.0 TiB)"


def test_torch_accelerator_device_capability_is_the_dtypes_a_tpu_tensor_may_have():
    from torchtpu import dtypes

    supported = torch.accelerator.get_device_capability("tpu:0")["supported_dtypes"]
    assert supported == set(dtypes.SUPPORTED)
    for dtype in supported:  # each of them makes a tpu tensor, as the capability promises
        assert torch.zeros(2, dtype=dtype).to("tpu:0").cpu().dtype == dtype
    with pytest.raises(TypeError, match="not supported on the tpu device"):
        torch.zeros(2, dtype=torch.uint16).to("tpu:0")


def test_torch_tpu_init_starts_the_runtime_as_torch_cuda_init(tmp_path):
    result = _run("""
        import torch
        import torchtpu
        before = torch.tpu.is_initialized()
        torch.tpu.init()
        torch.tpu.init()
        print(before, torch.tpu.is_initialized())
    """, env={"TORCHTPU_LOCK_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def test_torch_accelerator_empty_cache_is_torch_tpus():
    from torchtpu.distributed.host_transport import ReceiveBuffers

    buffers = ReceiveBuffers()
    buffers.take((1024,), torch.float32)
    torch.accelerator.empty_cache()
    assert buffers.pooled_bytes == 0


def test_torch_accelerator_synchronize_waits_and_reports_device_errors():
    from torchtpu.exec import memory

    a = torch.full((1024, 1024), 1.0 / 1024).to("tpu:0")
    product = a @ a @ a @ a  # ~0.1 s of matmuls, dispatched asynchronously
    assert not memory.to_array(product).is_ready()
    torch.accelerator.synchronize()
    assert memory.to_array(product).is_ready()
    torch.arange(4.0).to("tpu:0")[torch.tensor([1, 4]).to("tpu:0")]  # out of range: found on the device
    with pytest.raises(RuntimeError, match="DeviceCheckError: .*index out of range"):
        torch.accelerator.synchronize(0)
    torch.accelerator.synchronize()  # reported once, as torch.tpu.synchronize reports it


def test_rng_state_roundtrip_and_seeding():
    torch.tpu.manual_seed(123)
    state = torch.tpu.get_rng_state()
    a = torch.rand(5, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    b = torch.rand(5, device="tpu").cpu()
    assert torch.equal(a, b)
    torch.manual_seed(7)  # seeds every device, as for CUDA
    c = torch.rand(5, device="tpu").cpu()
    torch.manual_seed(7)
    assert torch.equal(c, torch.rand(5, device="tpu").cpu())
    assert not torch.equal(a, c)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_recomputes_with_the_forwards_random_draws(reentrant):
    """`torch.utils.checkpoint` restores the device's RNG state before recomputing the forward
    once `torch.tpu._initialized` says the runtime has started (it had no such attribute, and
    the recomputed dropout drew a new mask): the gradients are those of the plain forward."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4)).to("tpu")
    x = torch.randn(4, 8).to("tpu").requires_grad_()  # the reentrant form needs an input that does

    def gradients(run):
        torch.tpu.manual_seed(3)
        model.zero_grad()
        x.grad = None
        run(x).sum().backward()
        return [x.grad.cpu()] + [p.grad.cpu() for p in model.parameters()]

    plain = gradients(model)
    checkpointed = gradients(lambda x: checkpoint(model, x, use_reentrant=reentrant))
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_every_dtype(dtype):
    x = (torch.arange(24).reshape(4, 6) % 7).to(dtype)
    t = x.to("tpu")
    assert t.dtype == dtype and t.device.type == "tpu"
    assert torch.equal(t.cpu(), x)
    assert torch.equal(t.t().cpu(), x.t())
    assert t[1:3, ::2].cpu().tolist() == x[1:3, ::2].tolist()


def test_unsupported_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="uint32 is not supported on the tpu device"):
        torch.zeros(3, dtype=torch.uint32).to("tpu")
    with pytest.raises(TypeError, match="uint16 is not supported on the tpu device"):
        torch.empty(3, dtype=torch.uint16, device="tpu")


def test_a_tensor_too_large_to_address_is_an_error_as_on_cpu():
    # Made by the Python kernel, such a tensor aborted the process inside PyTorch's storage code.
    for size, stride in (((1 << 40, 1 << 40), None), ((1 << 61,), None), ((1 << 40, 2), (1 << 40, 1))):
        with pytest.raises(RuntimeError, match="Storage size calculation overflowed") as cpu:
            torch.empty_strided(size, stride) if stride else torch.empty(size)
        with pytest.raises(RuntimeError) as tpu:
            torch.empty_strided(size, stride, device="tpu") if stride else torch.empty(size, device="tpu")
        assert str(tpu.value) == str(cpu.value)


def test_item_tolist_numpy():
    t = torch.tensor([[1.5, -2.0], [3.0, 4.25]]).to("tpu")
    assert t[1, 1].item() == 4.25
    assert t.tolist() == [[1.5, -2.0], [3.0, 4.25]]
    with pytest.raises(TypeError, match="can't convert tpu:0 device type tensor to numpy"):
        t.numpy()


def test_copy_both_ways_and_between_devices():
    x = torch.randn(5, 3)
    t = torch.empty(5, 3, device="tpu")
    t.copy_(x)
    assert torch.equal(t.cpu(), x)
    y = torch.empty(5, 3)
    y.copy_(t)
    assert torch.equal(y, x)
    t1 = t.to("tpu:1")
    assert t1.device == torch.device("tpu:1") and torch.equal(t1.cpu(), x)
    t[:, 1].copy_(torch.ones(5))
    x[:, 1] = 1
    assert torch.equal(t.cpu(), x)
    x.add_(1)  # the device copy must not alias host memory
    assert not torch.equal(t.cpu(), x)


def test_pinned_host_memory_for_staging():
    """PyTorch asks the device for pinned host memory where it stages device data (DDP's reducer,
    `non_blocking` copies to the host, DCP's copy-ahead); such tensors report `is_pinned()`."""
    staged = torch.empty(6, pin_memory=True)
    assert staged.is_pinned() and not torch.empty(6).is_pinned()
    assert torch.arange(4.0).pin_memory().is_pinned()
    x = torch.randn(5, 3)
    moved = x.to("tpu").to("cpu", non_blocking=True)
    torch.tpu.synchronize()
    assert torch.equal(moved, x)


def test_module_to_moves_parameters_in_place():
    """As with CUDA, `Module.to` keeps each Parameter object: tied weights stay tied and an
    optimizer built before the move still steps the model's parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # an LM head tied to the input embedding
    reference = copy.deepcopy(model)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.to("tpu:1")
    assert list(model.parameters()) == params and model[1].weight is model[0].weight
    assert params[0].device == torch.device("tpu:1")
    ids = torch.tensor([1, 2, 3])
    with torch.tpu.precision("highest"):
        for m, opt, device in ((reference, torch.optim.SGD(reference.parameters(), lr=0.5), "cpu"),
                               (model, optimizer, "tpu:1")):
            m(ids.to(device)).logsumexp(-1).sum().backward()
            opt.step()
    torch.testing.assert_close(model[0].weight.detach().cpu(), reference[0].weight.detach())
    model.cpu()
    assert model[0].weight is params[0] and model[0].weight.device.type == "cpu"


def test_lazy_modules_move_to_tpu_before_their_first_batch():
    """`LazyLinear(...).to("tpu")`, as on CUDA: the copy of an uninitialized parameter (whose
    `.shape` raises) works, the first batch on tpu materializes the parameters there, and the
    model computes what the same one does on the CPU."""
    def lazy():
        return torch.nn.Sequential(torch.nn.LazyLinear(6), torch.nn.LazyBatchNorm1d(), torch.nn.ReLU(),
                                   torch.nn.LazyLinear(2))

    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    reference, model = lazy(), lazy().to("tpu")
    reference(x)
    model(x.to("tpu"))
    assert all(p.device.type == "tpu" and type(p) is torch.nn.Parameter for p in model.parameters())
    model.load_state_dict(reference.state_dict())
    with torch.tpu.precision("highest"):
        torch.testing.assert_close(model(x.to("tpu")).cpu(), reference(x))


def test_save_and_load_with_and_without_map_location():
    t = torch.randn(4, 6).to("tpu")
    buffer = io.BytesIO()
    torch.save({"t": t, "row": t[2], "bf16": t.to(torch.bfloat16)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded["t"].device == torch.device("tpu:0")
    assert torch.equal(loaded["t"].cpu(), t.cpu())
    assert torch.equal(loaded["row"].cpu(), t[2].cpu())
    assert torch.equal(loaded["bf16"].cpu(), t.to(torch.bfloat16).cpu())
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu")
    assert on_cpu["t"].device.type == "cpu" and torch.equal(on_cpu["t"], t.cpu())


def test_print_shows_values_and_device():
    text = repr(torch.tensor([1.0, 2.5]).to("tpu"))
    assert "1.0000, 2.5000" in text and "device='tpu:0'" in text


def test_mixed_devices_raise_pytorch_error():
    a = torch.ones(3, device="tpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + torch.ones(3, device="tpu:1")
    # A 0-dim CPU tensor is a scalar, as on CUDA.
    assert torch.equal((a + torch.tensor(2.0)).cpu(), torch.full((3,), 3.0))


def test_strict_ops_names_the_op():
    result = _run("""
        import torch, torchtpu
        x = torch.ones(3, device="tpu")
        try:
            torch.ops.aten._test_functorch_fallback(x, x)
        except NotImplementedError as e:
            print("ERROR:", e)
    """, env={"TORCHTPU_STRICT_OPS": "1", "TORCHTPU_DEVICE_LOCK": "0"})
    assert result.returncode == 0, result.stderr
    assert "ERROR: aten._test_functorch_fallback.default has no tpu lowering" in result.stdout
    assert "TORCHTPU_STRICT_OPS=1" in result.stdout


def test_cpu_fallback_is_counted_and_correct():
    result = _run("""
        import warnings, torch, torchtpu
        x = torch.arange(3.0, device="tpu")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = torch.ops.aten._test_functorch_fallback(x, x)
        print(out.device, out.cpu().tolist(), torchtpu.metrics()["cpu_fallback_ops"], len(caught))
    """, env={"TORCHTPU_DEVICE_LOCK": "0", "TORCHTPU_STRICT_OPS": "0"})
    assert result.returncode == 0, result.stderr
    expected = torch.ops.aten._test_functorch_fallback(torch.arange(3.0), torch.arange(3.0))
    assert f"tpu:0 {expected.tolist()}" in result.stdout
    assert "{'aten._test_functorch_fallback.default': 1} 1" in result.stdout


def test_second_process_on_a_held_device_is_refused(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import torch, sys; torch.ones(1, device='tpu:0'); "
                               "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "TORCHTPU_LOCK_DIR": str(tmp_path)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = _run("""
            import torch
            try:
                torch.ones(1, device="tpu:0")
            except RuntimeError as e:
                print("ERROR:", e)
            torch.ones(1, device="tpu:1")
            print("tpu:1 ok")
        """, env={"TORCHTPU_LOCK_DIR": str(tmp_path)})
        assert result.returncode == 0, result.stderr
        assert f"ERROR: tpu:0 is already in use by process {holder.pid}" in result.stdout
        assert "tpu:1 ok" in result.stdout
        unlocked = _run("import torch; torch.ones(1, device='tpu:0'); print('ok')",
                        env={"TORCHTPU_LOCK_DIR": str(tmp_path), "TORCHTPU_DEVICE_LOCK": "0"})
        assert unlocked.stdout.strip() == "ok", unlocked.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    again = _run("import torch; torch.ones(1, device='tpu:0'); print('ok')",
                 env={"TORCHTPU_LOCK_DIR": str(tmp_path)})
    assert again.stdout.strip() == "ok", again.stderr  # released when the holder exits


def test_device_count_set_too_late_is_an_error():
    result = _run("""
        import os, jax
        jax.devices()
        os.environ["TORCHTPU_NUM_DEVICES"] = "3"
        import torch
        try:
            torch.ones(1, device="tpu")
        except RuntimeError as e:
            print("ERROR:", e)
    """, env={"XLA_FLAGS": "", "TORCHTPU_NUM_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert "ERROR: TORCHTPU_NUM_DEVICES=3" in result.stdout and "already started" in result.stdout


def test_tensors_are_made_after_another_library_retypes_pycapsule_new():
    """`ctypes.pythonapi.PyCapsule_New` is shared by the process; `jax.ffi.pycapsule` (which
    registering any FFI kernel calls) sets its argument types to its own. Making tpu tensors,
    which builds DLPack capsules, must not depend on them."""
    import ctypes

    import jax

    jax.ffi.pycapsule(ctypes.cast(ctypes.pythonapi.Py_IsInitialized, ctypes.c_void_p).value)
    x = torch.arange(4.0, device="tpu") * 2
    assert x.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]
