"""The cryptographically secure stream (privacy.secure_noise): its distributions, its state, and a run that uses it."""

import json

import numpy as np
import pytest
import torch
from scipy import stats

from dptrain.config import load_config
from dptrain.randomness.generators import Randomness, TorchStream
from dptrain.randomness.secure import SecureStream
from dptrain.runs.run import run_training

KEY = bytes(range(32))


def test_aes_ctr_words_match_an_independent_encryption_of_zeros():
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    s = SecureStream(KEY)
    first, second = s.words(3), s.words(5)  # 24 bytes (2 blocks), then 40 bytes (3 blocks) from block 2 on
    keystream = Cipher(algorithms.AES(KEY), modes.CTR(bytes(16))).encryptor().update(bytes(16 * 5))
    assert first.tobytes() == keystream[:24]
    assert second.tobytes() == keystream[32 : 32 + 40]


def test_normal_noise_is_standard_normal():
    z = SecureStream(KEY).normal((200_000,), torch.float64).numpy()
    assert abs(z.mean()) < 5 / np.sqrt(len(z)) and abs(z.std() - 1) < 0.01
    assert stats.kstest(z, "norm").pvalue > 1e-3


def test_add_gaussian_has_the_requested_std_and_keeps_the_dtype():
    x = torch.full((100_000,), 3.0)
    y = SecureStream(KEY).add_gaussian(x, 2.5)
    assert y.dtype == torch.float32
    assert float((y - 3).std()) == pytest.approx(2.5, rel=0.02)


def test_uniforms_integers_and_permutations():
    s = SecureStream(KEY)
    u = s.uniform((100_000,)).numpy()
    assert u.min() >= 0 and u.max() < 1 and stats.kstest(u, "uniform").pvalue > 1e-3
    counts = np.bincount([s.integers(3, 10) for _ in range(7000)], minlength=10)[3:]
    assert counts.sum() == 7000 and stats.chisquare(counts).pvalue > 1e-3
    assert sorted(s.permutation(50).tolist()) == list(range(50))


def test_state_continues_the_same_stream():
    a = SecureStream(KEY)
    a.normal((7,))
    state = a.get_state()
    expected = a.normal((11,))
    b = SecureStream(bytes(32))
    b.set_state(state)
    assert torch.equal(b.normal((11,)), expected)
    with pytest.raises(Exception, match="kind"):
        TorchStream(0).set_state(state)


def test_privacy_critical_streams_are_secure_and_others_are_not():
    r = Randomness(secure=True)
    assert {r.stream(p).kind for p in ("noise", "sampling", "mixing", "preprocessing")} == {"secure"}
    assert r.stream("init").kind == "torch"


def test_a_run_with_secure_noise_trains_resumes_and_says_so(tmp_path):
    cfg = load_config(
        None,
        [
            "seed=2",
            'data.name="synthetic"',
            "data.options={n = 600, dim = 6, num_classes = 2, separation = 3.0}",
            'model.name="logistic"',
            "privacy.noise_multiplier=1.0",
            'privacy.accountant="rdp"',
            "privacy.secure_noise=true",
            "training.steps=8",
            "training.batch_size=40",
            "training.eval_every=4",
        ],
    )
    whole = run_training(cfg, tmp_path / "whole", progress=False)
    run_training(cfg, tmp_path / "cut", progress=False, stop_after=3)
    resumed = run_training(None, tmp_path / "cut", resume=True, progress=False)
    assert whole["secure_noise"] and "AES-256-CTR" in whole["randomness"]
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a) and resumed["epsilon"] == whole["epsilon"]
    assert json.loads((tmp_path / "cut" / "ledger.json").read_text())["releases"] == 8
