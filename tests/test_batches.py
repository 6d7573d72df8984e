"""Training data of any structure (dptrain.data.batches): a user's map-style Dataset works unchanged and gives exactly the
run the same tensors give; tuple inputs go to the model as positional arguments, dict inputs as keyword arguments
(without the label key); per-example gradients of structured inputs match the single-example loop; inconsistent
data and batch-mixing models are refused in one line."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from dptrain.data.batches import DatasetSource, TensorSource, as_source
from dptrain.engine.api import make_private
from dptrain.errors import DataError, ModelError
from dptrain.stages.per_example import make_grad_sampler, trainable_parameters

warnings.filterwarnings("ignore", message="not private")


class Pairs(Dataset):
    """A user's Dataset: (x_i, y_i) items, read one at a time."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.reads = 0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i], self.y[i]


def _data(n=64, d=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    return x, (x[:, 0] > 0).long()


def _run(data, steps=6, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    trainer = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), data, noise_multiplier=1.0, batch_size=16, seed=7, **options
    )
    trainer.train(steps=steps)
    return trainer, model


def test_a_dataset_gives_exactly_the_run_the_same_tensors_give():
    x, y = _data()
    a, model_a = _run((x, y))
    ds = Pairs(x, y)
    b, model_b = _run(ds, max_physical_batch_size=5)  # chunked reads
    assert a.ledger.to_dict() == b.ledger.to_dict()
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)
    # read through __getitem__ (not its x and y attributes), and only the sampled examples (plus one for the
    # structure and the independence probe's shapes)
    assert 0 < ds.reads < 6 * 16 * 2 + 5


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(2, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, a, b):
        return self.out(torch.tanh(self.a(a) + self.b(b)))


class Tokens(nn.Module):
    """Keyword inputs, as a Hugging Face model takes them: an embedding, a mask, a linear head."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(11, 4), nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask):
        h = (self.emb(input_ids) * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
        return self.head(h)


def _loop_grads(model, inputs, y, call):
    out = []
    for i in range(len(y)):
        model.zero_grad()
        loss = nn.functional.cross_entropy(call(model, i), y[i : i + 1])
        loss.backward()
        out.append({n: p.grad.clone() for n, p in trainable_parameters(model).items()})
    return out


@pytest.mark.parametrize("backend", ["func", "auto"])
def test_per_example_gradients_of_tuple_and_dict_inputs_match_the_loop(backend):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    cases = [
        (TwoInputs(), (torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)),
         lambda m, i, x: m(x[0][i : i + 1], x[1][i : i + 1])),
        (Tokens(), {"input_ids": torch.randint(0, 11, (6, 5), generator=g),
                    "attention_mask": torch.tensor([[1, 1, 1, 0, 0]] * 3 + [[1, 1, 1, 1, 1]] * 3).float()},
         lambda m, i, x: m(**{k: v[i : i + 1] for k, v in x.items()})),
    ]
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    for model, inputs, call in cases:
        sampler = make_grad_sampler(model, lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"), backend)
        grads, losses = sampler(inputs, y)
        assert losses.shape == (6,)
        want = _loop_grads(model, inputs, y, lambda m, i, call=call, inputs=inputs: call(m, i, inputs))
        got = grads.materialize()
        for i, w in enumerate(want):
            for n in w:
                assert torch.allclose(got[n][i], w[n], atol=1e-5), (type(model).__name__, n)


class Records(Dataset):
    def __init__(self, n=40):
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 11, (n, 5), generator=g)
        self.mask = torch.ones(n, 5)
        self.labels = (self.ids[:, 0] > 5).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def test_a_dict_dataset_trains_through_the_engine_with_keyword_inputs():
    torch.manual_seed(0)
    model = Tokens()
    before = {n: p.clone() for n, p in model.named_parameters()}
    trainer = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), Records(), noise_multiplier=1.0, batch_size=10, seed=3
    )
    trainer.train(steps=3)
    assert trainer.steps == 3 and trainer.ledger.releases == 3
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # the same records as tensors: (dict of inputs, labels)
    ds = Records()
    source = as_source(({"input_ids": ds.ids, "attention_mask": ds.mask}, ds.labels))
    inputs, labels = source.batch(torch.tensor([3, 1]))
    assert torch.equal(inputs["input_ids"], ds.ids[[3, 1]]) and torch.equal(labels, ds.labels[[3, 1]])


class Mixed(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return (torch.zeros(3), torch.tensor(0)) if i % 2 == 0 else (torch.zeros(3), torch.zeros(2), torch.tensor(0))


def test_inconsistent_or_unlabelled_datasets_are_refused_in_one_line():
    with pytest.raises(DataError, match="another structure than the items before it"):
        DatasetSource(Mixed()).batch(torch.arange(4))

    class NoLabel(Records):
        def __getitem__(self, i):
            return {"input_ids": self.ids[i]}

    with pytest.raises(DataError, match="without the label key 'labels'"):
        DatasetSource(NoLabel()).batch(torch.arange(2))
    with pytest.raises(DataError, match="map-style"):
        as_source(iter([1, 2]))


class BatchMixing(Tokens):
    def forward(self, input_ids, attention_mask):
        out = super().forward(input_ids, attention_mask)
        return out - out.mean(0)  # mixes the examples of a batch


def test_the_independence_check_sees_through_keyword_inputs():
    model = BatchMixing()
    with pytest.raises(ModelError, match="independence check failed"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), Records(), noise_multiplier=1.0, batch_size=8)


def test_memory_mapped_npz_and_idx_train_like_the_arrays_in_memory(tmp_path):
    import gzip
    import struct

    import numpy as np

    from dptrain.data.loaders import read_idx
    from dptrain.data.memmap import idx_dataset, npz_dataset

    x, y = _data()
    np.savez(tmp_path / "d.npz", x=x.numpy(), y=y.numpy(), x_test=x[:4].numpy(), y_test=y[:4].numpy())
    ds = npz_dataset(tmp_path / "d.npz")
    assert isinstance(ds.inputs, np.memmap) and len(ds) == 64 and len(npz_dataset(tmp_path / "d.npz", "test")) == 4
    a, model_a = _run((x, y))
    b, model_b = _run(ds)
    assert a.ledger.to_dict() == b.ledger.to_dict()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True))
    np.savez_compressed(tmp_path / "c.npz", x=x.numpy(), y=y.numpy())
    with pytest.raises(DataError, match="compressed"):
        npz_dataset(tmp_path / "c.npz")
    # IDX in the real format: magic 00 00 <dtype> <ndim>, big-endian dims, big-endian data
    images = (np.arange(5 * 4 * 3) % 251).astype(np.uint8).reshape(5, 4, 3)
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    (tmp_path / "img").write_bytes(bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 5, 4, 3) + images.tobytes())
    (tmp_path / "lab").write_bytes(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 5) + labels.tobytes())
    idx = idx_dataset(tmp_path / "img", tmp_path / "lab")
    assert np.array_equal(np.asarray(idx.inputs), read_idx(tmp_path / "img"))
    xb, yb = idx[2]
    assert torch.equal(xb, torch.from_numpy(images[2])) and int(yb) == 4
    (tmp_path / "img.gz").write_bytes(gzip.compress((tmp_path / "img").read_bytes()))
    with pytest.raises(DataError, match="gunzip"):
        idx_dataset(tmp_path / "img.gz", tmp_path / "lab")


def test_a_config_run_on_a_memory_mapped_npz_equals_the_run_in_memory(tmp_path, capsys):
    import json

    import numpy as np

    from dptrain.cli import main

    g = np.random.default_rng(0)
    x = g.standard_normal((300, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x[:240], y=y[:240], x_test=x[240:], y_test=y[240:])
    config = """seed = 3
[data]
name = "npz"
path = "{path}"
options = {{ num_classes = 2{mmap} }}
[model]
name = "mlp"
options = {{ hidden = [8] }}
[privacy]
noise_multiplier = 1.0
[training]
steps = 6
batch_size = 30
eval_every = 3
"""
    for name, mmap in (("mem", ""), ("map", ", mmap = true")):
        (tmp_path / f"{name}.toml").write_text(config.format(path=tmp_path / "d.npz", mmap=mmap))
        assert main(["train", "--config", str(tmp_path / f"{name}.toml"), "--out", str(tmp_path / name),
                     "--no-progress"]) == 0
    capsys.readouterr()
    assert (tmp_path / "mem" / "ledger.json").read_text() == (tmp_path / "map" / "ledger.json").read_text()
    a = torch.load(tmp_path / "mem" / "private" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "map" / "private" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((tmp_path / "map" / "summary.json").read_text())
    assert "memory-mapped" in summary["dataset"]
    np.savez(tmp_path / "no_test.npz", x=x, y=y)
    (tmp_path / "bad.toml").write_text(config.format(path=tmp_path / "no_test.npz", mmap=", mmap = true"))
    code = main(["train", "--config", str(tmp_path / "bad.toml"), "--out", str(tmp_path / "bad"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "needs the test arrays" in err and len(err.splitlines()) == 1


def test_a_dataset_label_out_of_range_is_a_one_line_error_and_releases_nothing():
    x, y = _data()
    y = y.clone()
    y[::3] = 7  # a 2-class model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 2))
    # The probe of real examples before training meets the bad label first; the message names the rule, not the
    # label's value (a value of the private data).
    with pytest.raises(DataError, match=r"labels must be class indices in \[0, number of the model's outputs\)") as e:
        make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), Pairs(x, y), noise_multiplier=1.0, batch_size=16, seed=1
        )
    assert "7" not in str(e.value)
    # Past the probe (bad labels only further into the data), a step refuses the batch and releases nothing.
    y[:20] = 0
    trainer = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), Pairs(x, y), noise_multiplier=1.0, batch_size=16, seed=1,
        max_physical_batch_size=8,
    )
    with pytest.raises(DataError, match="labels must be class indices"):
        while True:
            trainer.step()
    assert trainer.ledger.releases == trainer.steps


def test_the_automatic_chunk_counts_embedding_gradients_as_factored():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(50_000, 256), nn.Linear(256, 2)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    ids, y = torch.randint(0, 50_000, (40, 32)), torch.randint(0, 2, (40,))
    model = Bag()
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (ids, y), noise_multiplier=1.0,
                           batch_size=10)
    # materialized, one example's embedding gradient alone is 51 MB (5 examples per 256 MiB chunk)
    assert trainer.max_physical_batch_size > 1000


class RawRecords(Dataset):
    """Raw items (lists and ints) that only the user's collate_fn turns into tensors."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i].tolist(), "y": int(self.y[i])}


def _collate(items):
    return {"features": torch.tensor([r["x"] for r in items]), "labels": torch.tensor([r["y"] for r in items])}


class Keyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, features):
        return self.net(features)


def test_a_dataloader_is_read_through_its_dataset_and_collate_fn_and_its_sampler_replaced():
    """make_private(model, opt, loader): the loader's collate_fn makes dict inputs from raw items; its shuffle and
    batch size are replaced by the secret Poisson sampler (a SamplerReplacedWarning, once); the run equals the run on
    the same examples as tensors."""
    from dptrain.data.batches import SamplerReplacedWarning

    x, y = _data()
    loader = DataLoader(RawRecords(x, y), batch_size=32, shuffle=True, collate_fn=_collate)
    runs = []
    for data in (loader, ({"features": x}, y)):
        torch.manual_seed(0)
        model = Keyword()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = make_private(
                model, torch.optim.SGD(model.parameters(), lr=0.5), data, noise_multiplier=1.0, batch_size=16, seed=7,
                max_physical_batch_size=5,
            )
        replaced = [w for w in caught if issubclass(w.category, SamplerReplacedWarning)]
        assert len(replaced) == (1 if data is loader else 0)
        assert "\n" not in str(replaced[0].message) if replaced else True
        trainer.train(steps=4)
        runs.append((trainer.ledger.to_dict(), [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0] and runs[0][0]["entries"][0]["facts"]["sampling_rate"] == 16 / len(y)
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1], strict=True))
    # an empty Poisson batch is made by the collate_fn too (from one example, none kept)
    with pytest.warns(SamplerReplacedWarning):
        inputs, labels = as_source(loader).batch(torch.arange(0))
    assert inputs["features"].shape == (0, 5) and labels.shape == (0,)


def test_a_dataloader_of_tensors_is_its_dataset_and_bad_loaders_are_refused_in_one_line():
    x, y = _data()
    with pytest.warns(UserWarning, match="sampler, batch_size, shuffle and workers are replaced"):
        source = as_source(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    assert isinstance(source, TensorSource) and torch.equal(source.batch(torch.tensor([2, 0]))[0], x[[2, 0]])

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(x[0], y[0])])

    with pytest.raises(DataError, match="IterableDataset") as e:
        as_source(DataLoader(Stream(), batch_size=2))
    assert "\n" not in str(e.value)
    short = DataLoader(RawRecords(x, y), batch_size=4, collate_fn=lambda items: _collate(items[:-1]))
    with pytest.warns(UserWarning), pytest.raises(DataError, match="one row per example"):
        as_source(short).batch(torch.arange(3))
    failing = DataLoader(RawRecords(x, y), batch_size=4, collate_fn=lambda items: torch.tensor(items))
    with pytest.warns(UserWarning), pytest.raises(DataError, match=r"collate_fn failed .* \(\w+Error\)") as e:
        as_source(failing).batch(torch.arange(3))
    assert "0." not in str(e.value)  # (the collate_fn's own message would quote the examples)
    unlabelled = DataLoader(RawRecords(x, y), batch_size=4, collate_fn=lambda items: {"features": _collate(items)["features"]})
    with pytest.warns(UserWarning), pytest.raises(DataError, match="without the label key"):
        as_source(unlabelled).batch(torch.arange(3))


def test_a_tensordataset_of_several_inputs_takes_its_last_tensor_as_the_labels():
    """(inputs..., labels), as every Dataset item: TensorDataset(ids, mask, labels) trained on the mask as its labels
    (the README's Hugging Face loop crashed in torch; integer side inputs trained silently on the wrong labels)."""
    x = torch.randn(8, 3)
    aux = torch.zeros(8, dtype=torch.long)
    y = torch.arange(8) % 2
    for data in (TensorDataset(x, aux, y), DataLoader(TensorDataset(x, aux, y), batch_size=4)):
        source = as_source(data)
        inputs, labels = source.batch(torch.arange(8))
        assert torch.equal(labels, y) and isinstance(inputs, tuple)
        assert torch.equal(inputs[0], x) and torch.equal(inputs[1], aux)
    with pytest.raises(DataError, match=r"TensorDataset\(inputs\.\.\., labels\)"):
        as_source(TensorDataset(x))
    from dptrain.data.datasets import as_tensors

    with pytest.raises(DataError, match=r"TensorDataset\(x, y\)"):  # (one-input models: x, y only)
        as_tensors(TensorDataset(x, aux, y))
