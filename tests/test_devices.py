"""Devices: the model, per-example gradients, clipping, noise and the update live on the run's device, and no
tensor is created on an implicit default device. Tested on the CPU: with torch's default device set to "meta"
(tensors without data) and the run on device="cpu", any tensor the engine creates without naming its device lands
on meta and the step fails; every stage is exercised (Poisson sampling, layerwise and torch.func per-example
gradients, the per-module fallback, flat and l2_linf clipping, secure and torch noise, ModelMix's mixing,
checkpoints). A device this machine does not have is a one-line error, exit 2."""

import warnings

import pytest
import torch
from torch import nn

from dptrain.cli import main
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.engine.trainer import resolve_device
from dptrain.errors import ConfigError

warnings.filterwarnings("ignore", message="not private")


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.prelu, self.head = nn.Embedding(9, 4), nn.PReLU(), nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.prelu(self.emb(ids)).mean(1))


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 5, generator=g)
    y = (x[:, 0] > 0).long()
    ids = torch.randint(0, 9, (48, 6), generator=g)
    mlp = lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))  # noqa: E731
    return {
        "layerwise, flat, torch noise": (mlp, (x, y), {}),
        "func, l2_linf, secure noise": (mlp, (x, y), {"grad_sampler": "func", "clipping": "l2_linf", "linf_p": 4,
                                                       "secure_noise": True}),
        "embedding and per-module fallback": (Seq, (ids, y), {}),
        "a map-style Dataset": (mlp, _Items(x, y), {}),
    }


class _Items(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.xs, self.ys = x, y

    def __len__(self):
        return len(self.ys)

    def __getitem__(self, i):
        return self.xs[i], self.ys[i]


@pytest.mark.parametrize("case", list(_cases()))
def test_no_tensor_is_created_on_an_implicit_default_device(case):
    build, data, options = _cases()[case]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    torch.set_default_device("meta")
    try:
        trainer = make_private_with_epsilon(
            model, opt, data, target_epsilon=3.0, target_delta=1e-5, steps=4, batch_size=12, seed=1, device="cpu",
            **options,
        )
        trainer.train(steps=2)
        state = trainer.state_dict()
        trainer.train(steps=2)
        trainer.load_state_dict(state)  # a checkpoint round trip on the device
        trainer.train(steps=2)
        assert trainer.steps == 4
        assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())
    finally:
        torch.set_default_device(None)


def test_modelmix_mixes_on_the_runs_device():
    from dptrain.modelmix import ModelMixSGD

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=g)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(5, 2))
    opt = ModelMixSGD(model.parameters(), lr=0.2, tau=0.05, total_steps=3)
    torch.set_default_device("meta")
    try:
        trainer = make_private(model, opt, (x, y), noise_multiplier=1.0, batch_size=10, seed=2, device="cpu")
        trainer.train(steps=3)
    finally:
        torch.set_default_device(None)
    assert trainer.steps == 3 and all(torch.isfinite(p).all() for p in model.parameters())


def test_devices_are_resolved_or_refused_in_one_line(tmp_path, capsys):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "cuda:x"):
        with pytest.raises(ConfigError, match="device must be one of cpu, cuda, auto"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="not available on this machine"):
            resolve_device("cuda")
        cfg = tmp_path / "c.toml"
        cfg.write_text(
            '[data]\nname = "synthetic"\noptions = { n = 100, dim = 4 }\n[model]\nname = "logistic"\n'
            '[privacy]\nnoise_multiplier = 1.0\n[training]\nsteps = 2\nbatch_size = 10\ndevice = "cuda"\n'
        )
        code = main(["train", "--config", str(cfg), "--out", str(tmp_path / "o"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "not available on this machine" in err and len(err.splitlines()) == 1
        assert not (tmp_path / "o").exists()
