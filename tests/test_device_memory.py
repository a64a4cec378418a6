"""Memory given back between uses at fixed device addresses (`zbench.engine.device_memory`); the graph loop's KV
cache in it is tested with the loop (tests/test_rollout.py)."""

import pytest
import torch

from zbench.engine import device_memory
from zbench.engine.device_memory import DeviceMemoryError, ReleasableMemory

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's virtual memory management needs a GPU")


def test_the_cpu_has_no_releasable_memory_and_says_so():
    assert not device_memory.available(torch.device("cpu"))
    with pytest.raises(DeviceMemoryError, match=r"cpu cannot release memory at fixed addresses"):
        ReleasableMemory(1 << 20, torch.device("cpu"))


@pytest.mark.gpu
@cuda
def test_released_memory_goes_back_to_the_device_and_returns_at_the_same_address():
    device = torch.device("cuda", torch.cuda.current_device())
    assert device_memory.available(device)
    size = 2 << 30
    memory = ReleasableMemory(size, device)
    view = memory.tensor.view(torch.bfloat16)
    assert memory.held and memory.tensor.numel() == size and view.data_ptr() == memory.address
    view.fill_(3.0)
    assert float(view[-1]) == 3.0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_held = torch.cuda.mem_get_info(device)[0]
    memory.release()
    assert not memory.held
    assert torch.cuda.mem_get_info(device)[0] - free_held >= size  # the driver has the pages again
    # the pages can go to PyTorch's own allocator meanwhile, and back
    other = torch.empty(size, dtype=torch.uint8, device=device)
    del other
    torch.cuda.empty_cache()
    memory.restore()
    assert memory.held and memory.tensor.data_ptr() == memory.address and view.data_ptr() == memory.address
    view.fill_(5.0)
    assert float(view.float().sum()) == 5.0 * view.numel()
    memory.release()
    memory.release()  # twice: a no-op
    memory.restore()
    memory.restore()
