"""The public Python API and the package boundaries of DESIGN.md."""

import subprocess
import sys

import pytest
import torch

import dptrain

# One interpreter checks every light module in turn (each start of Python with torch installed took 2-3 s; six
# starts were one per module). The stages run in this order and each checks only modules absent so far, so a stage
# loads a heavy package exactly when its module, imported alone, would: the modules of the earlier stages are each
# checked not to load it.
IMPORT_STAGES = [  # (what a stage runs, the packages it must not load)
    ("import dptrain.cli; dptrain.cli.build_parser()",  # `dptrain --help`, a bad flag (dp_accounting + scipy: 1.9 s)
     ("torch", "dp_accounting", "scipy", "matplotlib")),
    ("import dptrain.schedules.kinds, dptrain.schedules.bounds", ("torch",)),
    ("import dptrain.accounting as a; a.epsilon(a.dpsgd_ledger(1.0, 0.01, 10), 1e-5)", ("torch",)),  # (DESIGN.md)
    # PrivacyArguments is read without transformers (the DPTrainer's module imports it: tests/test_trust.py counts it
    # as a module of the hf extra)
    ("import dptrain.huggingface as h; h.PrivacyArguments(noise_multiplier=1.0)", ("transformers", "peft")),
    ("import dptrain, dptrain.config, dptrain.data.loaders, dptrain.models.builders",
     ("transformers", "peft", "tokenizers")),
]


def test_light_modules_import_no_heavy_package():
    """The accountants never import torch, the parser no torch, dp_accounting, scipy or matplotlib, the schedules'
    calculators no torch, and the package, its loaders, builders and Trainer arguments no transformers."""
    code = "import sys\n" + "".join(
        f"{run}\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}), flush=True)\n"
        for run, heavy in IMPORT_STAGES
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = proc.stdout.strip().splitlines()
    assert len(loaded) == len(IMPORT_STAGES)
    for (run, _), names in zip(IMPORT_STAGES, loaded, strict=True):
        assert names == "[]", (run, names[:300])


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
