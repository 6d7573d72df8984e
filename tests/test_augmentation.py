"""Augmentation multiplicity (De et al. 2022; dptrain.stages.augmentation): each example's gradient is the mean of its K
views' gradients before clipping, so one example's clipped contribution stays within C whatever K; K = 1 without
transforms is today's step bit for bit; the views are crops within the padding and flips, drawn from the run's
augmentation stream (a privacy-critical stream: AES with secure_noise) and keyed by the example's index (so a resumed
run and any chunking see the same views)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dptrain import make_private
from dptrain.cli import main
from dptrain.config import load_config
from dptrain.errors import ConfigError, DataError
from dptrain.randomness.generators import Randomness
from dptrain.stages.augmentation import Augmentation, Multiplicity, mean_of_views, view_parameters, views
from dptrain.stages.clipping import FlatClipping
from dptrain.stages.per_example import make_grad_sampler


def _images(n=40, side=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, side, side, generator=g), torch.randint(0, 3, (n,), generator=g)


def _model(side=8, seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * side * side, 8), nn.Tanh(), nn.Linear(8, 3)
    )


def _trainer(augment, seed=5, ema=None, model=None, data=None, **options):
    model = model if model is not None else _model()
    x, y = data if data is not None else _images()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    options.setdefault("check_independence", False)
    return make_private(model, opt, (x, y), noise_multiplier=1.0, batch_size=10, seed=seed, augment=augment, ema=ema,
                        **options)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.params.items()}


@pytest.mark.parametrize("backend", ["auto", "func"])
def test_multiplicity_one_without_transforms_is_todays_step_bit_for_bit(backend):
    plain = _trainer(None, grad_sampler=backend)
    one = _trainer({"multiplicity": 1}, grad_sampler=backend)
    plain.train(steps=4)
    one.train(steps=4)
    a, b = _params(plain), _params(one)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert plain.ledger.to_dict() == one.ledger.to_dict()
    # and the augmented path did run (its key drawn each step), with views equal to the images
    assert one.augment is not None and one.augment.key is not None


@pytest.mark.parametrize("backend", ["auto", "func", "loop"])
def test_the_averaged_gradient_is_the_mean_of_single_view_gradients_by_hand(backend):
    model = _model()
    x, y = _images(6)
    idx = torch.arange(10, 16)
    aug = Augmentation(multiplicity=3, crop_padding=2, flip=True)
    stage = Multiplicity(aug)
    stage.key = 123456789
    grads, losses = stage(make_grad_sampler(model, lambda out, t: nn.functional.cross_entropy(out, t, reduction="none"),
                                            backend), x, y, idx)
    dense = grads.materialize()
    dy, dx, flips = view_parameters(stage.key, idx, aug)
    rows = views(x.repeat_interleave(3, 0), dy, dx, flips, 2)
    for i in range(6):
        expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        loss_sum = 0.0
        for k in range(3):
            model.zero_grad()
            loss = nn.functional.cross_entropy(model(rows[3 * i + k : 3 * i + k + 1]), y[i : i + 1])
            loss.backward()
            loss_sum += loss.item() if not loss.requires_grad else loss.detach().item()
            for n, p in model.named_parameters():
                expected[n] += p.grad / 3
        for n in expected:
            torch.testing.assert_close(dense[n][i], expected[n], rtol=1e-4, atol=1e-6)
        assert abs(float(losses[i]) - loss_sum / 3) < 1e-5


def test_factored_forms_average_exactly():
    """A Linear on [B, in] (kept as two factors), on sequences, and an Embedding: the mean over K views keeps the
    factored form where it pays, and its norms, weighted sums and materialized gradients equal the dense mean."""

    class Text(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 16)
            self.seq = nn.Linear(16, 16)
            self.head = nn.Linear(16, 16)
            self.out = nn.Linear(16, 3)

        def forward(self, ids):
            h = torch.tanh(self.seq(self.emb(ids)))  # [B, T, 16]: a Linear on sequences
            return self.out(torch.tanh(self.head(h.mean(1))))  # Linears on [B, 16]

    torch.manual_seed(0)
    model = Text()
    ids = torch.randint(0, 20, (12, 5))  # 4 examples x K = 3 rows
    y = torch.randint(0, 3, (12,))
    sampler = make_grad_sampler(model, lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"), "layerwise")
    grads, _ = sampler(ids, y)
    kinds = {n: type(p).__name__ for n, p in grads.parts().items()}
    assert kinds["head.weight"] == "_LinearFactors" and kinds["emb.weight"] == "_EmbeddingFactors"
    mean = mean_of_views(grads, 3)
    assert type(mean.parts()["head.weight"]).__name__ == "_LinearFactors"  # (K^2 (in + out) < K in out: kept)
    dense = {n: g.reshape(4, 3, *g.shape[1:]).mean(1) for n, g in grads.materialize().items()}
    got = mean.materialize()
    for n in dense:
        torch.testing.assert_close(got[n], dense[n], rtol=1e-5, atol=1e-7)
    f = torch.tensor([0.5, -1.0, 2.0, 0.25])
    sums = mean.weighted_sum(f)
    sq = mean.sq_norms()
    for n in dense:
        torch.testing.assert_close(sums[n], torch.tensordot(f, dense[n], dims=1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sq[n], dense[n].flatten(1).square().sum(1), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_one_example_contributes_at_most_the_clip_norm_whatever_k(k):
    """With every other example keeping its views (the coupling a secret key allows: docs/recipes.md), the clipped sum
    over a batch and over the batch without one example differ by that example's clipped mean of views: at most C,
    and (gradients far above C) about C."""
    model = _model()
    x, y = _images(12)
    idx = torch.arange(12)
    clip = FlatClipping(1e-3)
    stage = Multiplicity(Augmentation(multiplicity=k, crop_padding=2, flip=True))
    stage.key = 987654321
    sampler = make_grad_sampler(model, lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"), "auto")
    full, _ = clip.clip_and_sum(stage(sampler, x, y, idx)[0])
    for removed in (0, 5, 11):
        keep = idx != removed
        less, _ = clip.clip_and_sum(stage(sampler, x[keep], y[keep], idx[keep])[0])
        diff = torch.sqrt(sum((full[n] - less[n]).square().sum() for n in full))
        assert 0.99e-3 < float(diff) <= 1e-3 * (1 + 1e-5)


def test_with_a_known_key_removing_an_example_moves_the_others_views():
    """Why the views are as secret as the noise: the data set without example 0 re-indexes the examples after it, so
    under the same (known) key their views, hence the sum, change by more than C; the guarantee rests on the key's
    secrecy (the coupling above), not on fixed views."""
    model = _model()
    x, y = _images(12)
    clip = FlatClipping(1e-3)
    stage = Multiplicity(Augmentation(multiplicity=4, crop_padding=2, flip=True))
    stage.key = 987654321
    sampler = make_grad_sampler(model, lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"), "auto")
    full, _ = clip.clip_and_sum(stage(sampler, x, y, torch.arange(12))[0])
    less, _ = clip.clip_and_sum(stage(sampler, x[1:], y[1:], torch.arange(11))[0])  # example 0 gone, indices shifted
    assert float(torch.sqrt(sum((full[n] - less[n]).square().sum() for n in full))) > 1.5e-3


def test_with_secure_noise_the_views_come_from_aes():
    """privacy.secure_noise: the augmentation stream is the AES-256-CTR stream, the step's key 256 bits of it, and the
    views AES-256 of (example, view) under that key; offsets still uniform over the padding, flips about half."""
    stage = Multiplicity(Augmentation(multiplicity=4, crop_padding=3, flip=True))
    randomness = Randomness(None, secure=True, warn=False)
    stage.new_step(randomness.stream("augmentation"))
    assert type(randomness.stream("augmentation")).__name__ == "SecureStream"
    assert isinstance(stage.key, bytes) and len(stage.key) == 32
    dy, dx, flips = view_parameters(stage.key, torch.arange(3000), stage.augmentation)
    assert set(dy.tolist()) == set(range(7)) == set(dx.tolist()) and 0.45 < float(flips.double().mean()) < 0.55
    counts = np.bincount(dy.numpy(), minlength=7)
    assert counts.min() > 0.7 * counts.mean()  # (12000 offsets over 7 values)
    again, _, _ = view_parameters(stage.key, torch.arange(3000), stage.augmentation)
    assert torch.equal(dy, again)  # a function of the key and the example


def test_views_are_crops_within_the_padding_and_flips():
    aug = Augmentation(multiplicity=8, crop_padding=3, flip=True)
    x = torch.arange(2 * 5 * 6, dtype=torch.float32).reshape(2, 1, 5, 6) + 1  # distinct pixels: a view has one origin
    idx = torch.tensor([7, 123])
    dy, dx, flips = view_parameters(2024, idx, aug)
    out = views(x.repeat_interleave(8, 0), dy, dx, flips, 3)
    padded = nn.functional.pad(x, (3, 3, 3, 3))
    for r in range(16):
        image = padded[r // 8]
        matches = [
            (oy, ox, f)
            for oy in range(7)
            for ox in range(7)
            for f in (False, True)
            if torch.equal(out[r], (lambda c: c.flip(-1) if f else c)(image[:, oy : oy + 5, ox : ox + 6]))
        ]
        assert (int(dy[r]), int(dx[r]), bool(flips[r])) in matches
    # over many views: every offset in [0, 2p] appears, none outside, flips about half
    dy, dx, flips = view_parameters(99, torch.arange(2000), aug)
    assert set(dy.tolist()) == set(range(7)) == set(dx.tolist())
    assert 0.45 < float(flips.double().mean()) < 0.55
    assert not view_parameters(99, torch.arange(200), Augmentation(4, 3, False))[2].any()


def test_views_come_from_the_runs_augmentation_stream():
    """Seeded runs draw the same views, unseeded ones differ; the step's key is the next word of the run's
    augmentation stream, and the other streams are untouched by it."""
    keys = []
    for seed in (5, 5, 6, None, None):
        tr = _trainer({"multiplicity": 2, "crop_padding": 1}, seed=seed)
        tr.step()
        keys.append(tr.augment.key)
        if seed is not None:
            assert keys[-1] == int(Randomness(seed, warn=False).stream("augmentation").words(1)[0])
    assert keys[0] == keys[1] and len({keys[0], keys[2], keys[3], keys[4]}) == 4


def test_resume_is_bit_identical_with_augmentation_and_ema():
    whole = _trainer({"multiplicity": 3, "crop_padding": 2, "flip": True}, ema=0.9)
    whole.train(steps=6)
    first = _trainer({"multiplicity": 3, "crop_padding": 2, "flip": True}, ema=0.9)
    first.train(steps=3)
    state = first.state_dict()
    resumed = _trainer({"multiplicity": 3, "crop_padding": 2, "flip": True}, ema=0.9, seed=77)  # its own streams ...
    resumed.load_state_dict(state)  # ... replaced by the checkpoint's
    resumed.train(steps=3)
    a, b = _params(whole), _params(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(whole.weight_average.averages[n], resumed.weight_average.averages[n]) for n in a)


def test_the_physical_chunk_holds_the_views_of_its_examples():
    assert _trainer({"multiplicity": 4}, max_physical_batch_size=64).max_physical_batch_size == 16
    assert _trainer({"multiplicity": 128}, max_physical_batch_size=64).max_physical_batch_size == 1
    auto = _trainer(None).max_physical_batch_size
    assert _trainer({"multiplicity": 8}).max_physical_batch_size == auto // 8


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(30, 64),  # tabular rows
        torch.randint(0, 9, (30, 16)),  # token ids
        torch.randn(30, 81, 7, 7),  # ScatterNet features: a feature map, not an image
        torch.randn(30, 4, 4, 3),  # [C, H, W] or channels-last [H, W, C]? crops would cut the wrong axes
    ],
)
def test_non_image_inputs_are_refused_in_one_line(x):
    model = nn.Sequential(nn.Flatten(), nn.LazyLinear(3)) if x.dtype.is_floating_point else nn.Sequential(
        nn.Embedding(9, 4), nn.Flatten(), nn.Linear(64, 3))
    if x.dtype.is_floating_point:
        model(x[:1])
    with pytest.raises(DataError, match="training.augment applies to images") as e:
        _trainer({"multiplicity": 2}, model=model, data=(x, torch.randint(0, 3, (30,))))
    assert "\n" not in str(e.value)


def test_bad_augment_settings_are_refused():
    with pytest.raises(ConfigError, match="crop_padding must be smaller"):
        _trainer({"multiplicity": 2, "crop_padding": 8})
    with pytest.raises(ConfigError, match="multiplicity must be an integer >= 1"):
        _trainer({"multiplicity": 0})
    for key in ("multiplicity", "crop_padding"):  # (Python's integers: 10^30 was a ValueError in the first step)
        with pytest.raises(ConfigError, match=f"{key} must be an integer >= [01] that fits in 64 bits, got 10000"):
            Augmentation(**{key: 10**30})
    with pytest.raises(ConfigError, match="unknown key 'training.augment.rotate'"):
        _trainer({"rotate": 10})
    with pytest.raises(ConfigError, match="mirrors the images of mnist"):
        load_config(None, ["privacy.target_epsilon=3", 'data.name="mnist"', "training.augment.flip=true"])
    with pytest.raises(ConfigError, match="stages of DP-SGD"):
        load_config(None, ['training.algorithm="projected_noisy_sgd"', "privacy.target_epsilon=1", "training.ema=0.9"])
    with pytest.raises(ConfigError, match="data.features = 'scatternet' trains on feature maps"):  # (before: after
        load_config(None, ["privacy.target_epsilon=3", 'data.features="scatternet"',  # the features were computed)
                           'model.name="scatternet_linear"', "training.augment.multiplicity=2"])
    # DPSGD-F's preprocessing (or its normalization alone) makes flat feature rows of the images before training:
    # refused by the config, before any private statistic (before: the trainer's 'got [1, 64]' after the private mean)
    for pre in (['preprocessing.kind="private_mean"', "preprocessing.eps_f=0.05"], []):
        with pytest.raises(ConfigError, match=r"training.augment views images, and \[preprocessing\] turns them"):
            load_config(None, ["privacy.noise_multiplier=1", 'model.name="logistic"', "preprocessing.feature_norm=1",
                               *pre, "training.augment.multiplicity=2"])


def test_the_cli_refuses_a_bad_augment_key_in_one_line(tmp_path, capsys):
    code = main(["train", "--config", "configs/cnn28_quick.toml", "--out", str(tmp_path / "r"), "--no-progress",
                 "--set", "training.augment.multiplicity=0"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "multiplicity must be an integer >= 1" in err


def _image_npz(tmp_path) -> Path:
    """An .npz of 300 8x8 grey images (240 to train, 60 to test) whose class is the sign of the centre's mean."""
    g = np.random.default_rng(0)
    x = g.normal(size=(300, 1, 8, 8)).astype(np.float32)
    y = (x[:, 0, 2:6, 2:6].mean((1, 2)) > 0).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x[:240], y=y[:240], x_test=x[240:], y_test=y[240:])
    return tmp_path / "d.npz"


def test_more_views_than_memory_holds_stop_in_one_line(tmp_path, capsys):
    """An allocation failure (here K = 10^12 views of an example) is a one-line error, exit 2, whatever raised it."""
    out = tmp_path / "r"
    code = main(["train", "--out", str(out), "--no-progress", "--set", 'data.name="npz"', "--set",
                 f'data.path="{_image_npz(tmp_path)}"', "--set", 'model.name="mlp"', "--set",
                 "data.options.num_classes=2", "--set", "privacy.noise_multiplier=1.0", "--set", "training.steps=1",
                 "--set", "training.batch_size=40",
                 "--set", "training.augment.multiplicity=1000000000000"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "out of memory" in err and "multiplicity" in err
    assert not (out / "model.pt").exists()
    # (the same class elsewhere: a model of 10^14 weights, refused where it is built)
    code = main(["train", "--out", str(tmp_path / "big"), "--no-progress", "--set", 'data.name="synthetic"', "--set",
                 "privacy.noise_multiplier=1.0", "--set", 'model.name="mlp"', "--set",
                 "model.options={ hidden = [10000000, 10000000] }", "--set", "training.steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "out of memory: the model" in err


def test_a_run_with_augmentation_trains_images_from_a_config(tmp_path):
    """The config path end to end: an .npz of 8x8 images, K = 4 views with crops and flips."""
    from dptrain.runs.run import run_training

    cfg = load_config(None, [
        'data.name="npz"', f'data.path="{_image_npz(tmp_path)}"', "data.options.num_classes=2", 'model.name="mlp"',
        "privacy.noise_multiplier=1.0", "training.steps=4", "training.batch_size=40", "seed=1",
        "training.augment={ multiplicity = 4, crop_padding = 1, flip = true }",
    ])
    summary = run_training(cfg, tmp_path / "run", progress=False)
    assert summary["steps"] == 4 and summary["test_accuracy"] is not None
    # seeded: the attacker bound is labelled as the certificate is (not a bound on this run)
    assert summary["private"] is False and summary["membership_inference"]["certified"] is False
