"""What a ``transformers.Trainer`` may do that :class:`dptrain.huggingface.trainer.DPTrainer` cannot make private, each
refused in one line (a :class:`dptrain.errors.ConfigError`) that says why and what to do instead.

The classes of refusal: an option that changes which examples a logical batch holds (the accounting assumes dptrain's
secret sampling); one that trains from a gradient other than the private one (a loss scaler's unscaling, optimizers
that update inside the backward pass, a batch loss instead of per-example losses); one that spreads a step over
processes or devices (DataParallel, torchrun, DeepSpeed, FSDP); one that releases statistics of the private batches
(token counts); and one that would forget what was spent (resuming from a Trainer checkpoint, a hyperparameter search).
"""

from __future__ import annotations

from dptrain.errors import ConfigError

#: The Trainer methods a DPTrainer replaces: a subclass overriding one would train outside the private loop.
OWNED = ("training_step", "compute_loss", "get_train_dataloader", "_get_train_sampler", "get_batch_samples")


def check_overrides(trainer, base: type) -> None:
    """Refuse a subclass of ``base`` (the DPTrainer) that overrides a method the private loop owns."""
    for name in OWNED:
        if getattr(type(trainer), name) is not getattr(base, name):
            way = (
                "pass loss_fn=(outputs, labels) -> one loss per example instead"
                if name == "compute_loss"
                else "the DPTrainer draws the batches and computes the gradients itself"
            )
            raise ConfigError(f"a DPTrainer subclass may not override {name}(): {way}")


def check_arguments(args) -> None:
    """Refuse the TrainingArguments the private loop cannot account for (before the Trainer is made: some of them it
    would act on at once)."""
    import transformers

    optim = str(getattr(args.optim, "value", args.optim))
    if args.world_size > 1 or args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED:
        raise ConfigError(
            "DPTrainer runs in one process (torchrun, DeepSpeed and FSDP spread a step over processes); run one "
            "process, or train data parallel with `torchrun ... dptrain train`"
        )
    if args.n_gpu > 1:
        raise ConfigError(
            f"DPTrainer trains on one device: the Trainer would wrap the model in DataParallel across {args.n_gpu} "
            "GPUs; make one visible (CUDA_VISIBLE_DEVICES=0)"
        )
    if args.deepspeed or args.fsdp:
        raise ConfigError("DPTrainer does not run under DeepSpeed or FSDP (they own the backward pass and the step)")
    if args.fp16:
        raise ConfigError(
            "fp16 trains through a loss scaler, which would unscale the private gradient; use bf16=True (per-example "
            "gradients are then clipped and noised in float32)"
        )
    if args.torch_compile:
        raise ConfigError(
            "torch_compile=True: the per-example gradients read the model's eager modules; train without it"
        )
    checkpointing = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None)
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs",
                                                                               None) or {}
    if checkpointing and kwargs.get("use_reentrant"):
        raise ConfigError(
            "gradient checkpointing with use_reentrant=True runs the layers without autograd and differentiates them "
            "on the side, where no per-example gradient can be recorded (and the Trainer enables it on the model "
            "when training starts, whatever was enabled before); set TrainingArguments(gradient_checkpointing_kwargs="
            "{'use_reentrant': False}) (transformers' default)"
        )
    if args.auto_find_batch_size:
        raise ConfigError(
            "auto_find_batch_size changes the batch size during training, and with it the sampling rate the "
            "accounting assumes; set per_device_train_batch_size (the physical chunk) yourself"
        )
    if args.train_sampling_strategy != "random":
        raise ConfigError(
            f"train_sampling_strategy={args.train_sampling_strategy!r} chooses which examples a batch holds; the "
            "accounting needs dptrain's secret sampling (privacy_args.sampling): leave it 'random' (replaced)"
        )
    if args.include_num_input_tokens_seen not in ("no", False, None):
        raise ConfigError(
            "include_num_input_tokens_seen logs how many tokens the secret batches hold (not private); leave it 'no'"
        )
    if args.neftune_noise_alpha is not None:
        raise ConfigError(
            "neftune_noise_alpha: NEFTune's noise scales with the batch's padded length, so one example's gradient "
            "depends on the others; train without it"
        )
    if args.use_liger_kernel:
        raise ConfigError(
            "use_liger_kernel: Liger's fused kernels compute a batch loss without per-example logits; train without it"
        )
    if optim in ("lomo", "adalomo"):
        raise ConfigError(
            f"optim={optim!r} updates the weights inside the backward pass, from the gradient before its "
            "clipping and noise; choose another optimizer (any torch optimizer is post-processing)"
        )


def check_trainer(trainer) -> None:
    """Refuse the Trainer options (beside its arguments) the private loop cannot account for."""
    if trainer.compute_loss_func is not None:
        raise ConfigError(
            "compute_loss_func returns a loss over the batch; DP-SGD clips each example's gradient: pass "
            "loss_fn=(outputs, labels) -> one loss per example"
        )
    if trainer.model_init is not None:
        raise ConfigError(
            "model_init makes a new model for each train() (a hyperparameter search's trials); pass model= (one run, "
            "one model, one ledger)"
        )
    names = trainer.label_names
    if not names:
        raise ConfigError(
            "DPTrainer needs each example's label, and the Trainer found no label name in the model's forward "
            "arguments; set TrainingArguments(label_names=[the key of the label in your examples])"
        )
    check_held_out(trainer.eval_dataset, trainer.train_dataset, "the eval_dataset")


def _views(dataset, rows=None):
    """The (base dataset, its rows or None for all) that ``dataset`` reads: through torch's ``Subset`` (also
    ``random_split``'s parts) and ``ConcatDataset``, to the datasets that hold the examples."""
    import torch

    if isinstance(dataset, torch.utils.data.Subset):
        indices = [int(i) for i in dataset.indices]
        yield from _views(dataset.dataset, indices if rows is None else [indices[i] for i in rows])
    elif isinstance(dataset, torch.utils.data.ConcatDataset) and rows is None:
        for part in dataset.datasets:
            yield from _views(part)
    elif isinstance(dataset, torch.utils.data.ConcatDataset):
        ends = dataset.cumulative_sizes
        for k, part in enumerate(dataset.datasets):
            start = ends[k - 1] if k else 0
            yield from _views(part, [i - start for i in rows if start <= i < ends[k]])
    else:
        yield dataset, rows


def check_held_out(datasets, train, what: str) -> None:
    """Refuse evaluation or prediction ``datasets`` (one, or a dict of them) that hold training examples: ``train``
    itself, or rows of the same dataset through a ``Subset`` or ``ConcatDataset`` (the parts of one ``random_split``
    share no row, and pass). A copy of the examples in another object cannot be seen (docs/huggingface.md)."""
    trained: dict[int, set | None] = {}
    for base, rows in _views(train):
        held = trained.get(id(base), set())
        trained[id(base)] = None if rows is None or held is None else held | set(rows)
    for d in (datasets.values() if isinstance(datasets, dict) else [datasets]):
        if d is None or isinstance(d, str):
            continue
        for base, rows in _views(d):
            if id(base) not in trained:
                continue
            held = trained[id(base)]
            if held is None or rows is None or not held.isdisjoint(rows):
                raise ConfigError(
                    f"{what} holds training examples: evaluating on the private examples releases their "
                    "statistics; evaluate on held-out data (e.g. the other part of a random_split)"
                )


#: Why metrics of evaluation data not declared public are not logged as they are (the CLI's data.test_is_public).
NOT_PUBLIC = (
    "are computed from the evaluation examples, which are not declared public (the other part of a random_split of "
    "your data is as sensitive as the part trained on): set PrivacyArguments(eval_is_public=True) for a public, "
    "non-sensitive held-out set, or log_not_private=True to log the metrics labelled _not_private"
)


def check_evaluation(args, privacy_args) -> None:
    """Refuse evaluation whose metrics would leave the run unaccounted: during training (``eval_strategy``) on data
    not declared public, unless labelled (``log_not_private``); and any choice of the released model by them
    (``metric_for_best_model``: ``load_best_model_at_end``, early stopping), which no label makes private."""
    if privacy_args.eval_is_public:
        return
    if args.metric_for_best_model is not None:
        raise ConfigError(
            f"metric_for_best_model={args.metric_for_best_model!r} (load_best_model_at_end, early stopping) chooses "
            "the released model by its metrics on evaluation examples not declared public, an unaccounted release "
            "that no label makes private: set PrivacyArguments(eval_is_public=True) for a public, non-sensitive "
            "held-out set, or leave it unset"
        )
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no" and not privacy_args.log_not_private:
        raise ConfigError(f"evaluation during training (eval_strategy): its metrics {NOT_PUBLIC}")


def refuse_resume() -> None:
    raise ConfigError(
        "DPTrainer.train(resume_from_checkpoint=...): a Trainer checkpoint does not hold the privacy ledger, so the "
        "resumed run would forget what it spent; start a new run (dptrain train --resume resumes its own runs)"
    )


def whole_model_refusal(e: BaseException) -> str:
    """Why DPTrainer cannot train a model whose per-example gradients need the whole model differentiated example by
    example (``e``: the loop's WholeModelError, which names the layer), and what trains it."""
    reason = getattr(e, "reason", None)
    because = f" ({reason.rstrip('.')})" if reason else ""
    return (
        f"DPTrainer cannot train this model: its per-example gradients need the whole model differentiated example by "
        f"example{because}, which recomputes the forward pass, and a Trainer step runs it once; train it with "
        "dptrain.make_private(model, optimizer, train_dataset, ...).train() (the same DP-SGD and certificate), or "
        "fine-tune with an adapter whose layers record per-example gradients (LoRA)"
    )


def refuse_search() -> None:
    raise ConfigError(
        "DPTrainer.hyperparameter_search: every trial spends privacy on the same data and the best one is chosen "
        "from them; search privately with `dptrain tune`"
    )


__all__ = ["OWNED", "check_arguments", "check_held_out", "check_overrides", "check_trainer", "refuse_resume", "refuse_search"]
