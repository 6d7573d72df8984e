"""dptrain: differentially private training for PyTorch, with the tightest accounting that applies.

Quick start::

    import torch, dptrain
    split = dptrain.load_dataset("fashion-mnist")
    model = dptrain.build_model("cnn28", split.train.input_shape, split.train.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    trainer = dptrain.make_private_with_epsilon(model, optimizer, split.train, target_epsilon=3.0,
                                                target_delta=1e-5, epochs=1, batch_size=256, max_grad_norm=1.0)
    trainer.train(epochs=1)
    print(trainer.epsilon(), trainer.evaluate(split.test.x, split.test.y))

Names are imported lazily, so ``import dptrain.accounting`` (pure numpy/scipy/dp_accounting) never
imports torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "make_private": "dptrain.engine.api",
    "make_private_with_epsilon": "dptrain.engine.api",
    "make_private_loop": "dptrain.engine.private_loop",
    "PrivateTrainer": "dptrain.engine.trainer",
    "Budget": "dptrain.engine.trainer",
    "Ledger": "dptrain.accounting",
    "PrivacyReport": "dptrain.accounting",
    "epsilon": "dptrain.accounting",
    "certified_epsilon": "dptrain.accounting",
    "calibrate_noise": "dptrain.accounting",
    "calibrate_dpsgd_noise": "dptrain.accounting",
    "dpsgd_ledger": "dptrain.accounting",
    "register_accountant": "dptrain.accounting",
    "accountant_names": "dptrain.accounting",
    "build_model": "dptrain.models.builders",
    "convert_batchnorm_to_groupnorm": "dptrain.models.builders",
    "load_dataset": "dptrain.data.loaders",
    "load_config": "dptrain.config",
    "RunConfig": "dptrain.config",
    "run_training": "dptrain.runs.run",
    "DPTrainError": "dptrain.errors",
    "ConvexGLM": "dptrain.last_iterate",
    "ProjectedNoisySGD": "dptrain.last_iterate",
    "make_private_dpsgd_f": "dptrain.dpsgd_f",
    "FeaturePreprocessing": "dptrain.dpsgd_f",
    "keep_freed_memory": "dptrain.runs.cpu_memory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dptrain' has no attribute {name!r}")


def __dir__():
    return __all__
