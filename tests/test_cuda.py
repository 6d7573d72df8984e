"""On a GPU: per-example gradients equal the CPU's, the noise has its scale when drawn on the device, a run records the
ledger a CPU run records, and a checkpoint round trip continues exactly. Skipped where torch sees no GPU (this
project's CI machine has none); run with ``pytest tests/test_cuda.py`` where one is."""

import warnings

import pytest
import torch
from torch import nn

from dptrain.engine.api import make_private
from dptrain.models.builders import build_model
from dptrain.stages.per_example import cross_entropy_per_example, make_grad_sampler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
warnings.filterwarnings("ignore", message="not private")


def _data(n=64, shape=(1, 28, 28), classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("backend", ["layerwise", "func"])
def test_per_example_gradients_on_cuda_equal_the_cpus(backend):
    x, y = _data(16)
    torch.manual_seed(0)
    cpu_model = build_model("cnn28", (1, 28, 28), 10).double()
    gpu_model = build_model("cnn28", (1, 28, 28), 10).double()
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_model.cuda()
    cpu = make_grad_sampler(cpu_model, cross_entropy_per_example, backend)(x.double(), y)[0].materialize()
    gpu = make_grad_sampler(gpu_model, cross_entropy_per_example, backend)(x.double().cuda(), y.cuda())[0]
    for name, g in gpu.materialize().items():
        assert g.device.type == "cuda"
        torch.testing.assert_close(g.cpu(), cpu[name], rtol=1e-7, atol=1e-9)


def test_noise_drawn_on_cuda_has_its_scale():
    # Zero inputs and no bias: every clipped gradient is zero, so one step of lr 1 moves the weights by exactly
    # -noise / B, noise ~ N(0, (sigma C)^2) per coordinate.
    n, batch, sigma, clip = 64, 64, 2.0, 0.5
    model = nn.Linear(200, 500, bias=False)
    nn.init.zeros_(model.weight)
    trainer = make_private(
        model, torch.optim.SGD(model.parameters(), lr=1.0), (torch.zeros(n, 200), torch.zeros(n, dtype=torch.long)),
        noise_multiplier=sigma, max_grad_norm=clip, batch_size=batch, sampling="full", seed=0, device="cuda",
    )
    trainer.step()
    w = model.weight.detach()
    assert w.device.type == "cuda"
    noise = -w.flatten().double() * batch
    expected = sigma * clip
    assert abs(float(noise.std()) / expected - 1) < 0.02  # 100,000 draws: the std's relative error is about 0.2%
    assert abs(float(noise.mean())) < 0.02 * expected


def test_a_cuda_run_records_the_cpu_ledger_and_resumes_exactly():
    x, y = _data(256)

    def run(device, steps, state=None):
        torch.manual_seed(1)
        model = build_model("cnn28", (1, 28, 28), 10)
        trainer = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), (x, y), noise_multiplier=1.1, batch_size=32, seed=3,
            device=device,
        )
        if state is not None:
            trainer.load_state_dict(state)
        trainer.train(steps=steps)
        return trainer, model

    cpu_trainer, _ = run("cpu", 6)
    gpu_trainer, gpu_model = run("cuda", 6)
    assert gpu_trainer.ledger.to_dict() == cpu_trainer.ledger.to_dict()  # the same releases, recorded the same way
    assert all(p.device.type == "cuda" and torch.isfinite(p).all() for p in gpu_model.parameters())
    half, _ = run("cuda", 3)
    resumed, resumed_model = run("cuda", 3, state=half.state_dict())
    assert resumed.steps == 6
    # The same batches and noise (a different draw would move a weight by about lr sigma / B = 0.017); CUDA's
    # backward kernels may add in another order, hence a tolerance far below that.
    for a, b in zip(resumed_model.parameters(), gpu_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_augmentation_and_the_weight_average_on_cuda():
    """The views and their averaged gradients on the GPU equal the CPU's for the same key; a run with both stages
    records the CPU's ledger and continues from a checkpoint as an uninterrupted one."""
    from dptrain.stages.augmentation import Augmentation, Multiplicity

    x, y = _data(16)
    torch.manual_seed(0)
    cpu_model = build_model("cnn28", (1, 28, 28), 10).double()
    gpu_model = build_model("cnn28", (1, 28, 28), 10).double()
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_model.cuda()
    stage = Multiplicity(Augmentation(multiplicity=4, crop_padding=3, flip=True))
    stage.key = 31337
    idx = torch.arange(100, 116)
    cpu = stage(make_grad_sampler(cpu_model, cross_entropy_per_example, "auto"), x.double(), y, idx)[0].materialize()
    gpu = stage(make_grad_sampler(gpu_model, cross_entropy_per_example, "auto"), x.double().cuda(), y.cuda(), idx.cuda())
    for name, g in gpu[0].materialize().items():
        assert g.device.type == "cuda"
        torch.testing.assert_close(g.cpu(), cpu[name], rtol=1e-7, atol=1e-9)
    x, y = _data(256)

    def run(device, steps, state=None):
        torch.manual_seed(1)
        model = build_model("cnn28", (1, 28, 28), 10)
        trainer = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), (x, y), noise_multiplier=1.1, batch_size=32, seed=3,
            device=device, augment={"multiplicity": 4, "crop_padding": 2, "flip": True}, ema=0.9,
        )
        if state is not None:
            trainer.load_state_dict(state)
        trainer.train(steps=steps)
        return trainer

    whole = run("cuda", 6)
    assert whole.ledger.to_dict() == run("cpu", 6).ledger.to_dict()
    resumed = run("cuda", 3, state=run("cuda", 3).state_dict())
    for n, a in whole.weight_average.averages.items():
        assert a.device.type == "cuda"
        torch.testing.assert_close(resumed.weight_average.averages[n], a, rtol=1e-4, atol=1e-5)
