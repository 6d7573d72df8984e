"""The ``[modelmix]`` config section: ``training.update = "modelmix"`` trains with ModelMix's update rule (Xiao, Wan &
Devadas, "Differentially Private Deep Learning with ModelMix", Algorithm 1; docs/modelmix.md). Imports no torch.

    [training]
    update = "modelmix"
    learning_rate = 0.4

    [modelmix]
    tau = [[0.05, 0.5], [0.025, 0.5]]   # tau = 0.05 lr for the first half of the steps, 0.025 lr after
"""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.accounting.modelmix import tau_phases
from dptrain.config import RunConfig, Section, register_section, register_update, section_is_default
from dptrain.errors import ConfigError

#: Why momentum and Adam are refused (also the error message).
PLAIN_SGD_ONLY = (
    'training.update = "modelmix" takes plain SGD (training.optimizer = "sgd", training.momentum = 0): a momentum '
    "or Adam state is built from past noisy gradients, not from the released iterates alone, and ModelMix's privacy "
    "analysis conditions each step on the released iterates only"
)


@dataclass(frozen=True)
class ModelMixConfig:
    """tau as a multiple of the learning rate: a number, or phases [[tau_over_lr, fraction of the run], ...]."""

    tau: float | list = 0.05


def validate(cfg: RunConfig) -> None:
    t = cfg.training
    if t.update != "modelmix":
        if not section_is_default(cfg, "modelmix"):
            raise ConfigError('[modelmix] is for training.update = "modelmix"')
        return
    if t.algorithm != "dpsgd":
        raise ConfigError(f'training.update = "modelmix" is an update rule of DP-SGD, not of {t.algorithm!r}')
    if t.optimizer != "sgd" or t.momentum != 0:
        raise ConfigError(PLAIN_SGD_ONLY)
    tau_phases(_as_python(cfg.modelmix.tau))  # one-line ConfigError on a bad tau
    if cfg.privacy.sampling not in ("poisson", "full"):
        raise ConfigError(
            'training.update = "modelmix" needs privacy.sampling = "poisson" or "full": its accountant analyses '
            f"Poisson-subsampled steps, got {cfg.privacy.sampling!r}"
        )
    if t.batch_growth:
        raise ConfigError('training.update = "modelmix" needs a constant expected batch size (batch_growth = 0)')


def _as_python(tau):
    return [list(x) if isinstance(x, list | tuple) else x for x in tau] if isinstance(tau, list | tuple) else tau


register_update("modelmix")
register_section(Section("modelmix", ModelMixConfig, validate, stage="dptrain.modelmix.update:stage"))
