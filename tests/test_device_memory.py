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


def test_a_compiled_loop_that_cannot_give_its_cache_back_holds_it_and_says_so(capsys):
    """Where memory cannot be mapped at fixed addresses (here: the CPU), a compiled loop asked to release its cache
    holds it, since a cache allocated anew would make its recorded step record again, and says so."""
    from transformers import AutoModelForCausalLM

    from zbench.engine.rollout import GraphDecoder
    from zbench.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
    decoder = GraphDecoder(model, compile=True, release_cache=True)
    assert not decoder.release_cache and not decoder.cache_at_fixed_addresses
    assert "rollout.release_kv_cache: the graph loop holds its KV cache through training" in capsys.readouterr().out
    assert GraphDecoder(model, compile=False, release_cache=True).release_cache  # eager: dropped and made again
