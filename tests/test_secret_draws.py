"""Every draw that protects privacy comes from the run's secret streams, never from a global generator (torch's,
numpy's, Python's ``random``): two runs from the same entropy (here a seed: the streams are then its function, as
they are of the secret entropy otherwise), whose global generators are set to different states after the job is
built, release the same bits (the ledger, the model). With ``privacy.secure_noise`` every privacy-critical stream a
run draws from is the AES-256-CTR one. Covered: Poisson sampling, the Gaussian noise, BandMF's secret groups and
correlated noise, augmentation multiplicity's crops and flips, ModelMix's mixing weights, DPSGD-F's private mean, the
sentinel's secret places (every chunk of these runs' sizes is checked at the first step)."""

import random

import numpy as np
import pytest
import torch

from dptrain.config import load_config
from dptrain.randomness.generators import PRIVACY_CRITICAL
from dptrain.runs.run import RunHooks, run_training

COMMON = [
    "seed=3", "privacy.secure_noise=true", "privacy.noise_multiplier=1.0", 'privacy.accountant="rdp"',
    "training.steps=4", "training.batch_size=16", "training.eval_every=4",
]
RUNS = {
    "augmentation and BandMF": [
        'data.name="npz"', "data.options={num_classes = 2}", 'model.name="mlp"', "model.options={hidden = [8]}",
        "training.augment={multiplicity = 2, crop_padding = 1, flip = true}", 'noise.mechanism="bandmf"', "noise.bands=2",
    ],
    "ModelMix": [
        'data.name="synthetic"', "data.options={n = 120, dim = 4, num_classes = 2}", 'model.name="logistic"',
        'training.update="modelmix"', "training.learning_rate=0.4",
    ],
    "DPSGD-F": [
        'data.name="synthetic"', "data.options={n = 120, dim = 4, num_classes = 2}", 'model.name="logistic"',
        'preprocessing.kind="private_mean"', "preprocessing.feature_norm=1.0", "preprocessing.eps_f=0.5",
    ],
}


def _scramble(state: int):
    def prepare(job):
        torch.manual_seed(state)
        np.random.seed(state)
        random.seed(state)

    return prepare


@pytest.mark.parametrize("run", list(RUNS))
def test_privacy_draws_read_no_global_generator(run, tmp_path):
    images = tmp_path / "images.npz"
    x = np.random.default_rng(0).normal(size=(80, 1, 6, 6)).astype(np.float32)
    np.savez(images, x=x, y=(x[:, 0, 0, 0] > 0).astype(np.int64))
    cfg = load_config(None, [*COMMON, *RUNS[run], *([f'data.path="{images}"'] if "npz" in str(RUNS[run]) else [])])
    outs = [tmp_path / str(k) for k in (1, 2)]
    for k, out in enumerate(outs):
        run_training(cfg, out, progress=False, hooks=RunHooks(prepare=_scramble(k)))
    ledgers = [(out / "ledger.json").read_text() for out in outs]
    assert ledgers[0] == ledgers[1]
    a, b = (torch.load(out / "model.pt", weights_only=True)["state_dict"] for out in outs)
    assert all(torch.equal(a[n], b[n]) for n in a), run
    streams = torch.load(outs[0] / "private" / "checkpoint.pt", weights_only=True)["randomness"]["streams"]
    used = set(streams) & set(PRIVACY_CRITICAL)
    assert used >= {"sampling", "noise"} and all(streams[p]["kind"] == "secure" for p in used), streams
