"""The privacy arguments of :class:`dptrain.huggingface.trainer.DPTrainer`: a dataclass that transformers'
``HfArgumentParser`` reads beside ``TrainingArguments`` (no field shares a name with one of TrainingArguments': the
per-example clip norm is ``per_sample_max_grad_norm``, as in dp-transformers, since ``max_grad_norm`` is the Trainer's
clipping of the released gradient). Imports neither torch nor transformers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrivacyArguments:
    """What makes a Trainer run private. Exactly one of ``target_epsilon`` (the smallest noise that certifies the planned
    steps at ``delta``, a budget the run never exceeds) and ``noise_multiplier`` (fixed noise; the run reports what it
    spent). The expected logical batch is ``per_device_train_batch_size x gradient_accumulation_steps`` of the
    TrainingArguments, drawn by ``sampling`` (Poisson: each example in with probability batch / n)."""

    target_epsilon: float | None = field(
        default=None, metadata={"help": "epsilon the planned steps may spend (calibrates the noise; or noise_multiplier)"}
    )
    noise_multiplier: float | None = field(
        default=None, metadata={"help": "noise std over the clip norm (or target_epsilon)"}
    )
    delta: float = field(default=1e-5, metadata={"help": "delta of the (epsilon, delta) certificate"})
    per_sample_max_grad_norm: float = field(
        default=1.0, metadata={"help": "each example's gradient is clipped to this L2 norm before the noise"}
    )
    sampling: str = field(
        default="poisson",
        metadata={"help": "how logical batches are drawn: poisson (default), shuffled, fixed_size, cyclic, full"},
    )
    accountant: str = field(
        default="auto", metadata={"help": "the accountant that certifies the run (auto: the tightest that applies)"}
    )
    secure_noise: bool = field(default=False, metadata={"help": "draw the noise from AES-256-CTR"})
    log_not_private: bool = field(
        default=False,
        metadata={"help": "log statistics of the private batches (the training loss), labelled _not_private"},
    )
    eval_is_public: bool = field(
        default=False,
        metadata={"help": "the evaluation data are public (not sensitive): their metrics are logged as they are; "
                          "otherwise evaluation is refused, or logged labelled _not_private with log_not_private"},
    )
    buffer_updates: str = field(
        default="refuse",
        metadata={"help": "state a training-mode forward pass writes into the model: refuse (default), restore (put "
                          "back after every chunk: a cache of the last batch), not_private (kept; the run NOT private)"},
    )
    privacy_seed: int | None = field(
        default=None,
        metadata={"help": "seed of the noise and the batches: reproducible and NOT private (never TrainingArguments.seed)"},
    )


__all__ = ["PrivacyArguments"]
