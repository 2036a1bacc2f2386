"""The 8-bit wire on CUDA (``-m gpu``): the codec gives the CPU's bytes and values bit for bit,
and the error-feedback DDP hook on an NCCL group (one rank per GPU: two GPUs) gives the gloo
hook's gradients and byte counts bit for bit."""
import pytest
import torch

from lowp.distributed.launch import run_local_group
from lowp.distributed.wire import WireFormat, decode, encode, wire_bytes

pytestmark = pytest.mark.gpu

FORMATS = [WireFormat("fp8_e4m3"), WireFormat("fp8_e5m2", block=64, scale="bf16"),
           WireFormat("int8", block=32, scale="fp32"), WireFormat("fp8_e4m3", rounding="stochastic")]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_the_codec_on_cuda_gives_the_cpu_bytes(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_007, generator=g) * torch.exp2(torch.randint(-20, 20, (10_007,), generator=g).float())
    x[:32] = 0.0                      # a zero block
    x[64] = float("nan")              # a NaN block
    x[100] = 1e-42                    # an fp32 subnormal
    key = 12345 if fmt.rounding == "stochastic" else None
    cpu = encode(x, fmt, key, first=7)
    cuda = encode(x.cuda(), fmt, key, first=7)
    assert cuda.device.type == "cuda" and cuda.numel() == wire_bytes(fmt, x.numel())
    assert torch.equal(cuda.cpu(), cpu)
    back = decode(cuda, fmt, x.numel())
    assert back.device.type == "cuda"
    assert torch.equal(back.cpu().view(torch.int32), decode(cpu, fmt, x.numel()).view(torch.int32))


class _Exact(torch.nn.Module):
    """Two parameters whose gradients are exactly the given coefficients on any device (a product
    with 1 and a sum's backward), so the hook sees the same bits on the CPU and on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(1000))
        self.b = torch.nn.Parameter(torch.zeros(37))

    def forward(self, ca: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        return (self.a * ca).sum() + (self.b * cb).sum()


def _hook_rank(rank: int, world_size: int, device: str) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lowp.distributed.compressed import CompressedState, register_compressed_hook

    if device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    model = _Exact().to(device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if device != "cpu" else None)
    state = CompressedState(error_feedback=True)
    register_compressed_hook(ddp, state)
    grads = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        ca = torch.randn(1000, generator=g) * torch.exp2(torch.randint(-10, 10, (1000,), generator=g).float())
        cb = torch.randn(37, generator=g)
        ddp.zero_grad()
        ddp(ca.to(device), cb.to(device)).backward()
        grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
    return {"grads": grads, "wire_bytes": state.wire_bytes, "backend": dist.get_backend()}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL runs one rank per GPU: needs 2 GPUs")
def test_the_hook_on_an_nccl_group_equals_the_gloo_hook():
    """Two ranks on NCCL (CUDA tensors) and two on gloo (CPU tensors), the same exact gradients:
    after the 8-bit wire with error feedback every step's gradients are the same bits, and the
    wire bytes (counted from the collectives' tensors) the same."""
    cuda = run_local_group(_hook_rank, 2, "cuda", backend="nccl", timeout_s=60.0)[0]
    cpu = run_local_group(_hook_rank, 2, "cpu", backend="gloo", timeout_s=60.0)[0]
    assert (cuda["backend"], cpu["backend"]) == ("nccl", "gloo")
    assert cuda["wire_bytes"] == cpu["wire_bytes"] > 0
    for step_cuda, step_cpu in zip(cuda["grads"], cpu["grads"]):
        for a, b in zip(step_cuda, step_cpu):
            assert torch.equal(a, b)
    assert not torch.equal(cpu["grads"][0][0], torch.zeros(1000))
