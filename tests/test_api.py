"""The public Python API and the package boundaries of DESIGN.md."""

import subprocess
import sys

import pytest
import torch

import dptrain


def test_accounting_never_imports_torch():
    code = (
        "import sys, dptrain.accounting as a; a.epsilon(a.dpsgd_ledger(1.0, 0.01, 10), 1e-5); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_exported_name_resolves():
    for name in dptrain.__all__:
        assert getattr(dptrain, name) is not None


@pytest.mark.slow
def test_quick_start_api_on_digits():
    torch.manual_seed(0)
    split = dptrain.load_dataset("digits")
    model = dptrain.build_model("mlp", split.train.input_shape, split.train.num_classes, hidden=[32])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = dptrain.make_private_with_epsilon(
        model, optimizer, split.train, target_epsilon=4.0, target_delta=1e-5, epochs=15, batch_size=64
    )
    trainer.train(epochs=15)
    report = trainer.epsilon()
    assert report.certified and report.epsilon <= 4.0
    assert trainer.evaluate(split.test.x, split.test.y) > 0.6  # 10 classes: chance is 0.1
