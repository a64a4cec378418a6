"""GPU memory whose physical pages are given back between uses and taken again at the same device addresses.

The graph loop's recorded decode step (`zbench.engine.rollout.GraphDecoder`) reads and writes its KV cache at the
addresses it was recorded with. A cache allocated by PyTorch therefore stays allocated while the model trains:
15 GB at GRPO's 128 rows a GPU of the Qwen3-0.6B shape. CUDA's virtual memory management separates the two:
- an address range is reserved once;
- physical memory is created and mapped into it before a rollout (`ReleasableMemory.restore`);
- it is unmapped and released after the rollout (`ReleasableMemory.release`).

The recorded graph replays over the same addresses. Between rollouts the memory is the driver's again, for
training to allocate. vLLM's sleep mode does the same through an allocator of its own. The calls go to the CUDA
driver library through ctypes. `available` says where it lacks them (no CUDA, a driver without the calls, a
device without virtual memory management); the loop then keeps its cache.

What the memory holds after `restore` is undefined: its user writes it before reading (the loop zeroes its cache
before each rollout).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import weakref
from typing import Any

import torch

_SUCCESS = 0
_OUT_OF_MEMORY = 2
_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
_ATTRIBUTE_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compression_type", ctypes.c_ubyte), ("gpu_direct_rdma_capable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requested_handle_types", ctypes.c_int), ("location", _Location),
                ("win32_handle_meta_data", ctypes.c_void_p), ("alloc_flags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_u64, _size, _p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
_SIGNATURES: dict[str, list[Any]] = {
    "cuDeviceGetAttribute": [_p(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuCtxGetCurrent": [_p(ctypes.c_void_p)],
    "cuMemGetAllocationGranularity": [_p(_size), _p(_AllocationProp), ctypes.c_int],
    "cuMemAddressReserve": [_p(_u64), _size, _size, _u64, ctypes.c_ulonglong],
    "cuMemAddressFree": [_u64, _size],
    "cuMemCreate": [_p(_u64), _size, _p(_AllocationProp), ctypes.c_ulonglong],
    "cuMemRelease": [_u64],
    "cuMemMap": [_u64, _size, _size, _u64, ctypes.c_ulonglong],
    "cuMemUnmap": [_u64, _size],
    "cuMemSetAccess": [_u64, _size, _p(_AccessDesc), _size],
    "cuGetErrorString": [ctypes.c_int, _p(ctypes.c_char_p)],
}


class DeviceMemoryError(RuntimeError):
    """A CUDA driver call on releasable memory failed; the message names the call and the driver's error."""


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library with the calls used here typed, or None where it or one of them is missing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name, args in _SIGNATURES.items():
        function = getattr(lib, name, None)
        if function is None:
            return None
        function.argtypes, function.restype = args, ctypes.c_int
    return lib


def _check(result: int, call: str) -> None:
    if result == _SUCCESS:
        return
    text = ctypes.c_char_p()
    lib = _driver()
    if lib is not None:
        lib.cuGetErrorString(result, ctypes.byref(text))
    message = f"{call} failed: CUDA driver error {result} ({(text.value or b'no description').decode()})"
    if result == _OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(message)
    raise DeviceMemoryError(message)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _current_context(device: torch.device) -> None:
    """Make PyTorch's context for `device` current on this thread, where the driver calls look for it."""
    torch.cuda.set_device(device)
    torch.cuda.synchronize(device)  # initialises the runtime's primary context if nothing on this thread has
    context = ctypes.c_void_p()
    _check(_driver().cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")  # type: ignore[union-attr]
    if not context.value:
        raise DeviceMemoryError(f"no CUDA context is current for {device} on this thread")


def available(device: torch.device) -> bool:
    """Whether memory on `device` can be released and restored at fixed addresses (`ReleasableMemory`)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    lib = _driver()
    if lib is None:
        return False
    supported = ctypes.c_int(0)
    torch.cuda.init()
    if lib.cuDeviceGetAttribute(ctypes.byref(supported), _ATTRIBUTE_VMM_SUPPORTED, _index(device)) != _SUCCESS:
        return False
    return bool(supported.value)


class _Interface:
    """The `__cuda_array_interface__` PyTorch reads to view the range as a uint8 tensor. Each tensor viewing it keeps
    this object alive, and its finalizer frees the address range: never while a view of it exists (at interpreter
    exit the driver frees it with the process's context)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def _free(address: int, size: int, handle: list[int | None], device: torch.device) -> None:
    lib = _driver()
    if lib is None:
        return
    if handle[0] is not None:
        with contextlib.suppress(Exception):  # a device in error still gets its pages and range back
            torch.cuda.synchronize(device)  # no queued kernel may still touch the pages
        lib.cuMemUnmap(address, size)
        lib.cuMemRelease(handle[0])
        handle[0] = None
    lib.cuMemAddressFree(address, size)


class ReleasableMemory:
    """`nbytes` of device memory at one address range for its whole life, viewed as the uint8 tensor `tensor`,
    whose physical memory `release` gives back to the driver and `restore` takes again (held on creation).

    Between `release` and `restore` nothing may read or write the range: a kernel that does faults. What it holds
    after `restore` is undefined."""

    def __init__(self, nbytes: int, device: torch.device):
        if not available(device):
            raise DeviceMemoryError(f"{device} cannot release memory at fixed addresses (CUDA virtual memory "
                                    "management): see zbench.engine.device_memory.available")
        lib = _driver()
        assert lib is not None
        self.device = torch.device("cuda", _index(device))
        _current_context(self.device)
        self._prop = _AllocationProp(type=_ALLOCATION_PINNED, location=_Location(_LOCATION_DEVICE, self.device.index))
        self._access = _AccessDesc(location=_Location(_LOCATION_DEVICE, self.device.index), flags=_ACCESS_READ_WRITE)
        granularity = ctypes.c_size_t()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self._prop),
                                                 _GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity")
        self.nbytes = nbytes
        self.size = -(-max(nbytes, 1) // granularity.value) * granularity.value
        address = ctypes.c_uint64()
        _check(lib.cuMemAddressReserve(ctypes.byref(address), self.size, 0, 0, 0), "cuMemAddressReserve")
        self.address = address.value
        self._handle: list[int | None] = [None]  # the physical allocation mapped now, shared with the finalizer
        interface = _Interface(self.address, nbytes)
        weakref.finalize(interface, _free, self.address, self.size, self._handle, self.device).atexit = False
        self.restore()
        self.tensor = torch.as_tensor(interface, device=self.device)
        if self.tensor.data_ptr() != self.address:
            raise DeviceMemoryError(f"the tensor over {self.address:#x} starts at {self.tensor.data_ptr():#x}")

    @property
    def held(self) -> bool:
        """Whether physical memory is mapped now."""
        return self._handle[0] is not None

    def restore(self) -> None:
        """Map physical memory into the range again (a no-op while it is held). Where the device is short of it,
        PyTorch's cached free blocks are given back first and the allocation tried once more."""
        if self.held:
            return
        lib = _driver()
        assert lib is not None
        _current_context(self.device)
        handle = ctypes.c_uint64()
        result = lib.cuMemCreate(ctypes.byref(handle), self.size, ctypes.byref(self._prop), 0)
        if result == _OUT_OF_MEMORY:
            torch.cuda.empty_cache()
            result = lib.cuMemCreate(ctypes.byref(handle), self.size, ctypes.byref(self._prop), 0)
        _check(result, f"cuMemCreate of {self.size / 2**30:.2f} GiB on {self.device}")
        mapped = False
        try:
            _check(lib.cuMemMap(self.address, self.size, 0, handle.value, 0), "cuMemMap")
            mapped = True
            _check(lib.cuMemSetAccess(self.address, self.size, ctypes.byref(self._access), 1), "cuMemSetAccess")
        except BaseException:
            if mapped:
                lib.cuMemUnmap(self.address, self.size)
            lib.cuMemRelease(handle.value)
            raise
        self._handle[0] = handle.value

    def release(self) -> None:
        """Give the physical memory back to the driver once the device's queued work is done (a no-op while
        released); the addresses stay reserved for `restore`."""
        if not self.held:
            return
        lib = _driver()
        assert lib is not None
        _current_context(self.device)  # synchronizes: no queued kernel may still touch the pages
        handle = self._handle[0]
        assert handle is not None
        _check(lib.cuMemUnmap(self.address, self.size), "cuMemUnmap")
        self._handle[0] = None
        _check(lib.cuMemRelease(handle), "cuMemRelease")
