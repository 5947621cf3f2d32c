"""transfer.py: a forward's host tables packed into one buffer and viewed back, bit for bit."""

import pytest
import torch

from sgl_ragged.transfer import pack, to_device, unpack


def _tables(gen: torch.Generator) -> list[torch.Tensor]:
    """Tables of every dtype and shape a plan's transfer carries, odd byte counts included."""
    return [
        torch.randint(-2**40, 2**40, (7,), generator=gen),  # int64
        torch.randint(-9, 9, (3, 5), generator=gen, dtype=torch.int32),
        torch.rand(2, 3, 4, generator=gen),  # float32
        torch.rand(5, 3, generator=gen) > 0.5,  # bool, 15 bytes
        torch.empty(0, 64, dtype=torch.float32),  # empty
        torch.randint(0, 9, (1,), generator=gen, dtype=torch.int32),
        torch.tensor(3.5),  # 0-dim
        torch.randint(0, 9, (6, 2), generator=gen)[:, 0],  # a non-contiguous view
    ]


def test_pack_unpack_gives_every_tensor_back():
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        tables = _tables(gen)
        buffer, spans = pack(tables)
        assert buffer.dtype == torch.uint8 and all(start % 8 == 0 for start, *_ in spans)
        back = unpack(buffer, spans)
        for want, got in zip(tables, back, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)


def test_to_device_on_a_cpu_is_the_tensors():
    gen = torch.Generator().manual_seed(1)
    tables = _tables(gen)
    for want, got in zip(tables, to_device(tables, "cpu"), strict=True):
        assert torch.equal(got, want) and got.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned, "
                    "non-blocking copies; scripts/gpu_check.sh runs this)")
def test_to_device_does_not_wait_for_the_stream_it_queues_on():
    """The copy queues behind a long kernel on the current stream without the host waiting
    for it, and gives the tensors once that kernel is done."""
    gen = torch.Generator().manual_seed(2)
    tables = _tables(gen)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the forward in flight (about 0.1 s)
    moved = to_device(tables, "cuda")
    waited = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    for want, got in zip(tables, moved, strict=True):
        assert got.is_cuda and torch.equal(got.cpu(), want)
    assert not waited, "to_device waited on the host for the work queued before it"
