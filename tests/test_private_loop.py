"""A user's own training loop (dptrain.engine.private_loop): the same steps as the trainer's, bit for bit, for the same seed,
data and loss; virtual batches equal one chunk within float rounding; every misuse is a one-line LoopError that
releases nothing and rolls the streams back (the next logical batch is the one an error-free loop draws); LR
schedulers, clip_grad_norm_ and a weight regularizer passed as extra are post-processing; a data-dependent extra is
refused; a budget stops the batches; a DataLoader's dataset and collate_fn are used."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dptrain.data.batches import SamplerReplacedWarning
from dptrain.engine.api import make_private
from dptrain.engine.private_loop import LoopError, make_private_loop
from dptrain.errors import ConfigError, DPTrainError, ModelError

N, D = 256, 5
G = torch.Generator().manual_seed(0)
X = torch.randn(N, D, generator=G)
Y = (X[:, 0] + 0.3 * X[:, 1] > 0).long()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 2))


def _loop(model=None, lr=0.5, chunk=16, data=None, **options):
    model = model or _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    options = {"noise_multiplier": 1.0, "batch_size": 64, "seed": 7, **options}
    loop = make_private_loop(model, opt, (X, Y) if data is None else data, max_physical_batch_size=chunk, **options)
    return loop, model, opt


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _train(loop, model, opt, steps, after_backward=None):
    """The loop a user writes; returns each optimizer step's step_skipped."""
    skipped = []
    for x, y in loop.batches(steps=steps):
        loop.backward(_losses(model, x, y))
        if after_backward is not None:
            after_backward()
        opt.step()
        skipped.append(loop.step_skipped)
        opt.zero_grad()
    return skipped


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_a_loop_takes_the_trainers_steps_bit_for_bit():
    """Same seed, data, loss (cross-entropy), chunking and plain SGD: the same batches, clipped sums added chunk by chunk
    in the same order, the same noise: the parameters are bit-identical, not merely close."""
    model = _model()
    trainer = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), (X, Y), noise_multiplier=1.0, batch_size=64, seed=7,
        max_physical_batch_size=16,
    )
    trainer.train(steps=5)
    loop, user_model, opt = _loop()
    skipped = _train(loop, user_model, opt, 5)
    assert loop.steps == 5 and skipped.count(False) == 5 and len(skipped) > 5  # virtual batches: steps skipped
    assert loop.ledger.to_dict() == trainer.ledger.to_dict()
    assert _equal(_params(user_model), _params(model))
    assert loop.epsilon(accountant="rdp").epsilon == trainer.epsilon(accountant="rdp").epsilon


def test_a_non_final_chunks_step_changes_nothing():
    loop, model, opt = _loop()
    seen = []
    for x, y in loop.batches(steps=2):
        before = _params(model)
        loop.backward(_losses(model, x, y))
        last = loop.is_last_chunk
        opt.step()
        seen.append((last, loop.step_skipped, _equal(before, _params(model))))
        opt.zero_grad()
    assert seen and all(skipped == (not last) == unchanged for last, skipped, unchanged in seen)
    assert sum(last for last, _, _ in seen) == 2


def test_virtual_batches_equal_one_chunk_within_float_rounding():
    """A logical batch of 64 (expected) in chunks of 16 against one chunk: the same batches and noise, the sum of the
    clipped gradients added chunk by chunk instead of in one weighted sum (float rounding differs: close, not equal)."""
    a, model_a, opt_a = _loop(chunk=16)
    b, model_b, opt_b = _loop(chunk=N)
    assert len(_train(a, model_a, opt_a, 6)) > 6 and len(_train(b, model_b, opt_b, 6)) == 6
    assert a.ledger.to_dict() == b.ledger.to_dict()
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5)


def test_an_empty_poisson_batch_is_one_chunk_of_no_example_and_released_like_the_trainers():
    model = _model()
    trainer = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), (X, Y), noise_multiplier=1.0, batch_size=1, seed=3
    )
    trainer.train(steps=8)
    loop, user_model, opt = _loop(batch_size=1, seed=3)
    sizes = []
    for x, y in loop.batches(steps=8):
        sizes.append(len(y))
        loop.backward(_losses(user_model, x, y))
        opt.step()
        opt.zero_grad()
    assert 0 in sizes and len(sizes) == 8
    assert loop.ledger.to_dict() == trainer.ledger.to_dict()
    assert _equal(_params(user_model), _params(model))


def _one_line(error) -> str:
    text = str(error.value)
    assert isinstance(error.value, DPTrainError) and "\n" not in text
    return text


def _misuse(body, match):
    """``body(loop, model, opt, x, y)`` misuses the loop on the first chunk: a one-line LoopError, nothing released, and
    the streams rolled back (two correct steps afterwards equal two steps of a loop that never erred)."""
    loop, model, opt = _loop()
    with pytest.raises(LoopError) as error:
        for x, y in loop.batches(steps=1):
            body(loop, model, opt, x, y)
    assert match in _one_line(error)
    assert loop.steps == 0 and not loop.ledger.entries
    assert all(p.grad is None for p in model.parameters())
    _train(loop, model, opt, 2)
    clean, clean_model, clean_opt = _loop()
    _train(clean, clean_model, clean_opt, 2)
    assert _equal(_params(model), _params(clean_model))


def test_two_backward_passes_on_one_chunk_are_refused():
    def body(loop, model, opt, x, y):
        loop.backward(_losses(model, x, y))
        loop.backward(_losses(model, x, y))

    _misuse(body, "twice on one chunk")


def test_a_step_without_a_backward_is_refused():
    def body(loop, model, opt, x, y):
        _losses(model, x, y)
        opt.step()

    _misuse(body, "without loop.backward")


def test_a_loop_body_without_backward_is_refused():
    _misuse(lambda loop, model, opt, x, y: _losses(model, x, y), "without loop.backward")


def test_a_batch_the_loop_did_not_hand_out_is_refused():
    def other_batch(loop, model, opt, x, y):  # a batch of the same length from elsewhere
        loop.backward(_losses(model, X[: len(y)] + 1, y))

    _misuse(other_batch, "did not hand out")

    def stale_losses(loop, model, opt, x, y):  # losses of a forward pass made before the chunk was handed out
        loop.backward(stale[: len(y)])

    stale = _losses(_model(), X, Y)
    _misuse(stale_losses, "not called on the chunk")

    def mean_loss(loop, model, opt, x, y):
        loop.backward(_losses(model, x, y).mean())

    _misuse(mean_loss, "one loss per example")

    def detached(loop, model, opt, x, y):
        loop.backward(_losses(model, x, y).detach())

    _misuse(detached, "do not come from the model's outputs")


def test_a_cast_or_moved_copy_of_the_chunk_is_the_chunk():
    loop, model, opt = _loop()
    for x, y in loop.batches(steps=2):
        loop.backward(F.cross_entropy(model(x.double().float().clone()), y, reduction="none"))
        opt.step()
        opt.zero_grad()
    assert loop.steps == 2


def test_a_backward_of_the_users_own_is_refused():
    def own_backward(loop, model, opt, x, y):
        losses = _losses(model, x, y)
        losses.mean().backward(retain_graph=True)
        loop.backward(losses)

    _misuse(own_backward, "backward pass of your own")

    # after the release, before the step: what it added to the private gradient is dropped, the step refused
    loop, model, opt = _loop(chunk=N)
    with pytest.raises(LoopError) as error:
        for x, y in loop.batches(steps=1):
            losses = _losses(model, x, y)
            loop.backward(losses)
            model(x).sum().backward()
            opt.step()
    assert "backward pass of your own" in _one_line(error)
    assert loop.steps == 1 and all(p.grad is None for p in model.parameters())  # released (accounted), not applied
    assert _equal(_params(model), _params(_model()))


def test_losses_that_mix_examples_are_refused():
    def centred(loop, model, opt, x, y):
        losses = _losses(model, x, y)
        loop.backward(losses - losses.mean())

    _misuse(centred, "mix examples")


def test_a_released_batch_without_its_step_is_refused_and_stays_accounted():
    loop, model, opt = _loop(chunk=N)
    with pytest.raises(LoopError) as error:
        for x, y in loop.batches(steps=2):
            loop.backward(_losses(model, x, y))
    assert "optimizer.step() was not called" in _one_line(error)
    assert loop.steps == 1 and len(loop.ledger.entries) == 1


def test_a_second_step_and_calls_outside_the_loop_are_refused():
    loop, model, opt = _loop(chunk=N)
    with pytest.raises(LoopError) as error:
        for x, y in loop.batches(steps=1):
            loop.backward(_losses(model, x, y))
            opt.step()
            opt.step()
    assert "twice for one logical batch" in _one_line(error)
    with pytest.raises(LoopError) as error:
        opt.step()
    assert "outside a loop body" in _one_line(error)
    with pytest.raises(LoopError) as error:
        loop.backward(_losses(model, X[:4], Y[:4]))
    assert "inside its loop body" in _one_line(error)
    loop.close()
    opt.step()  # the optimizer's own step again
    with pytest.raises(LoopError):
        loop.batches(steps=1)


def test_a_changed_sampling_is_refused():
    from dptrain.stages.batch_selection import make_sampler

    loop, model, opt = _loop()
    _train(loop, model, opt, 1)
    loop.trainer.sampler = make_sampler("poisson", N, 128)  # (what the ledger records would not be what was used)
    with pytest.raises(LoopError) as error:
        _train(loop, model, opt, 1)
    assert "sampling changed" in _one_line(error) and loop.steps == 1

    class Growing(Dataset):
        def __init__(self):
            self.n = N

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return X[i], Y[i]

    data = Growing()
    loop, model, opt = _loop(data=data)
    _train(loop, model, opt, 1)
    data.n = N - 10
    with pytest.raises(LoopError, match="sampling changed"):
        _train(loop, model, opt, 1)


def test_an_error_in_the_users_code_releases_nothing_and_the_loop_resumes_as_if_it_never_happened():
    loop, model, opt = _loop()
    with pytest.raises(RuntimeError, match="user"):
        for i, (x, y) in enumerate(loop.batches(steps=5)):
            loop.backward(_losses(model, x, y))
            if loop.steps == 2 and not loop.is_last_chunk and i > 0:
                raise RuntimeError("user code failed")  # in the middle of the third logical batch
            opt.step()
            opt.zero_grad()
    assert loop.steps == 2 and loop.trainer.ledger.to_dict() == _ledger_after(2)
    assert loop.state_dict()["steps"] == 2  # between logical batches again: the iteration was ended at once
    _train(loop, model, opt, 3)
    clean, clean_model, clean_opt = _loop()
    _train(clean, clean_model, clean_opt, 5)
    assert loop.ledger.to_dict() == clean.ledger.to_dict()
    assert _equal(_params(model), _params(clean_model))


def _ledger_after(steps):
    loop, model, opt = _loop()
    _train(loop, model, opt, steps)
    return loop.ledger.to_dict()


@pytest.mark.usefixtures("sigint_raises")  # tests/conftest.py
def test_a_signal_between_the_release_and_the_step_waits_for_the_update():
    import signal

    loop, model, opt = _loop(chunk=N)
    before = _params(model)
    with pytest.raises(KeyboardInterrupt):
        for x, y in loop.batches(steps=3):
            loop.backward(_losses(model, x, y))
            signal.raise_signal(signal.SIGINT)  # (Ctrl-C after the release: held)
            opt.step()  # the update is applied, then the signal delivered
    assert loop.steps == 1 and not _equal(before, _params(model))
    assert loop.state_dict()["steps"] == 1


def test_a_checkpoint_between_steps_resumes_into_the_same_run():
    loop, model, opt = _loop()
    _train(loop, model, opt, 2)
    state = loop.state_dict()
    with pytest.raises(LoopError, match="inside a logical batch"):
        for _x, _y in loop.batches(steps=1):
            loop.state_dict()
    resumed, resumed_model, resumed_opt = _loop()
    resumed.load_state_dict(state)
    _train(resumed, resumed_model, resumed_opt, 2)
    clean, clean_model, clean_opt = _loop()
    _train(clean, clean_model, clean_opt, 4)
    assert resumed.ledger.to_dict() == clean.ledger.to_dict()
    assert _equal(_params(resumed_model), _params(clean_model))


@pytest.mark.parametrize("made", ["before", "after"])
def test_an_lr_scheduler_follows_the_optimizer_steps(made):
    """A scheduler stepped after each real step (not after a skipped one) equals setting the learning rate by hand,
    whether it was made before the loop (it wrapped optimizer.step first) or after (it wraps the loop's)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    make = lambda: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    sched = make() if made == "before" else None
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, seed=7, max_physical_batch_size=16)
    sched = sched or make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch warns when a scheduler steps before its optimizer)
        for x, y in loop.batches(steps=4):
            loop.backward(_losses(model, x, y))
            opt.step()
            if not loop.step_skipped:
                sched.step()
            opt.zero_grad()
    assert sched.get_last_lr() == [0.5 * 0.5**4]
    manual, manual_model, manual_opt = _loop()
    for x, y in manual.batches(steps=4):
        manual.backward(_losses(manual_model, x, y))
        manual_opt.step()
        if not manual.step_skipped:
            manual_opt.param_groups[0]["lr"] *= 0.5
        manual_opt.zero_grad()
    assert _equal(_params(model), _params(manual_model))
    loop.close()


def test_clip_grad_norm_is_post_processing_of_the_private_gradient():
    loop, model, opt = _loop(lr=1.0)
    reference, reference_model, reference_opt = _loop(lr=1.0)
    private = []

    def record():  # (and clip as the loop below does, so that both take the same steps)
        if reference.is_last_chunk:
            private.append([p.grad.clone() for p in reference_model.parameters()])
        torch.nn.utils.clip_grad_norm_(reference_model.parameters(), 0.01)

    _train(reference, reference_model, reference_opt, 3, after_backward=record)
    moves = []
    for x, y in loop.batches(steps=3):
        loop.backward(_losses(model, x, y))
        if loop.is_last_chunk:  # p.grad holds the noisy averaged gradient: the reference loop's
            assert _equal([p.grad for p in model.parameters()], private[len(moves)])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        before = _params(model)
        opt.step()
        if not loop.step_skipped:
            assert norm > 0.01  # (the noise alone has norm ~ sigma C / B sqrt(d))
            moves.append(torch.cat([(a - b).flatten() for a, b in zip(_params(model), before, strict=True)]).norm())
        opt.zero_grad()
    assert len(moves) == 3 and all(m <= 0.01 * (1 + 1e-5) for m in moves)
    assert loop.ledger.to_dict() == reference.ledger.to_dict()


def test_a_weight_regularizer_as_extra_equals_weight_decay():
    """extra = wd/2 ||w||^2 on every chunk: its gradient wd w, averaged over the chunks, added to the private gradient:
    SGD's weight_decay=wd (same noise, same batches)."""
    wd = 0.1
    loop, model, opt = _loop()
    for x, y in loop.batches(steps=4):
        loop.backward(_losses(model, x, y), extra=lambda params: 0.5 * wd * sum(p.pow(2).sum() for p in params.values()))
        opt.step()
        opt.zero_grad()
    decayed_model = _model()
    decayed_opt = torch.optim.SGD(decayed_model.parameters(), lr=0.5, weight_decay=wd)
    decayed = make_private_loop(
        decayed_model, decayed_opt, (X, Y), noise_multiplier=1.0, batch_size=64, seed=7, max_physical_batch_size=16
    )
    _train(decayed, decayed_model, decayed_opt, 4)
    plain, plain_model, plain_opt = _loop()
    _train(plain, plain_model, plain_opt, 4)
    assert loop.ledger.to_dict() == decayed.ledger.to_dict()
    for p, q, r in zip(model.parameters(), decayed_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)
        assert not torch.allclose(p, r, atol=1e-4)


def test_an_extra_computed_from_the_examples_is_refused():
    def from_inputs(loop, model, opt, x, y):
        loop.backward(_losses(model, x, y), extra=lambda p: p["0.weight"].sum() * x.mean())

    _misuse(from_inputs, "extra depends on the chunk's examples")

    def from_activations(loop, model, opt, x, y):  # a hidden layer's output on the chunk, kept by a hook
        kept = []
        handle = model[1].register_forward_hook(lambda module, args, out: kept.append(out))
        losses = _losses(model, x, y)
        handle.remove()
        loop.backward(losses, extra=lambda p: kept[0].pow(2).mean())

    _misuse(from_activations, "extra depends on the chunk's examples")

    # whatever autograd does not record: a detached copy, a number taken out, integer labels, a mask
    for term in (
        lambda p, x, y: (p["0.weight"] * x.detach().mean(0)).sum(),
        lambda p, x, y: (p["0.weight"] * (p["0.weight"] + x.detach().mean(0))).sum(),
        lambda p, x, y: p["0.weight"].sum() * x.mean().item(),
        lambda p, x, y: p["2.bias"].sum() * y.float().mean(),
        lambda p, x, y: torch.where(x.detach()[:1, :1] > 0, p["0.weight"][:1, :1], 0.0).sum(),
        lambda p, x, y: p["0.weight"].sum() * float(x.detach().numpy().mean()),
    ):

        loop, model, opt = _loop()
        with pytest.raises(LoopError) as error:
            for x, y in loop.batches(steps=1):
                seen = x.detach().clone(), y.clone()
                loop.backward(_losses(model, x, y), extra=lambda p, x=x, y=y, term=term: term(p, x, y))
        assert "extra reads the chunk's examples" in _one_line(error)
        assert loop.steps == 0 and all(p.grad is None for p in model.parameters())
        assert torch.equal(x, seen[0]) and torch.equal(y, seen[1])  # the chunk's values are restored

    def a_tensor(loop, model, opt, x, y):  # (a tensor made in the loop body cannot be checked)
        loop.backward(_losses(model, x, y), extra=model[0].weight.pow(2).sum())

    _misuse(a_tensor, "extra is a function of the parameters")

    def from_nothing(loop, model, opt, x, y):
        loop.backward(_losses(model, x, y), extra=lambda p: torch.tensor(1.0))

    _misuse(from_nothing, "scalar tensor computed from the trainable parameters")


def test_an_extra_reading_a_parameter_the_loop_does_not_privatize_is_refused():
    other = nn.Parameter(torch.ones(3))

    def foreign(loop, model, opt, x, y):
        loop.backward(_losses(model, x, y), extra=lambda p: p["0.weight"].sum() * other.sum())

    _misuse(foreign, "not a parameter the loop privatizes")


# --- every parameter the optimizer steps is one the loop privatizes -------------------------------------------------


@pytest.mark.parametrize("how", ["autograd.backward(inputs=)", "a hand-written .grad", "in the optimizer only"])
def test_a_parameter_added_after_the_loop_is_refused_at_the_step(how):
    loop, model, opt = _loop(chunk=N)
    added = nn.Parameter(torch.zeros(D))
    if how == "in the optimizer only":
        opt.add_param_group({"params": [added]})
    else:
        model.register_parameter("added", added)
        opt.add_param_group({"params": [added]})
    with pytest.raises(LoopError) as error:
        for x, y in loop.batches(steps=1):
            loop.backward(_losses(model, x, y))
            if how == "autograd.backward(inputs=)":
                torch.autograd.backward((added * x.mean(0)).sum() * 100, inputs=[added])
            else:
                added.grad = -100 * x.mean(0)
            opt.step()
    assert "does not privatize" in _one_line(error)
    assert torch.equal(added.detach(), torch.zeros(D))  # never stepped, with any gradient
    assert loop.steps == 1 and len(loop.ledger.entries) == 1  # the release stays accounted
    kept = [p.detach().clone() for n, p in model.named_parameters() if n != "added"]
    assert _equal(kept, _params(_model()))  # nothing applied


@pytest.mark.parametrize("closure", ["a backward pass of its own", "a gradient edited in place"])
def test_an_optimizer_step_with_a_closure_is_refused_before_it_runs(closure):
    """optimizer.step(closure): the optimizer calls the closure, which recomputes the loss and its gradient (or edits
    the released one) inside the step, so the update applied is not the release. It was applied (an unclipped,
    unnoised gradient x100) and seen only at the next batch, the run still private."""
    loop, model, opt = _loop(chunk=N)
    with pytest.raises(LoopError) as error:
        for x, y in loop.batches(steps=1):
            loop.backward(_losses(model, x, y))
            released = _params(model)

            def again(x=x, y=y):
                if closure == "a backward pass of its own":
                    loss = _losses(model, x, y).mean() * 100
                    loss.backward()
                    return loss
                with torch.no_grad():
                    for p in model.parameters():
                        p.grad.add_(x.mean() * 100)
                return None

            opt.step(again)
    assert "closure" in _one_line(error)
    assert _equal(_params(model), released) and loop.steps == 1  # nothing applied; the release stays accounted


def test_a_released_gradient_replaced_before_the_step_is_refused():
    loop, model, opt = _loop(chunk=N)
    with pytest.raises(LoopError) as error:
        for x, y in loop.batches(steps=1):
            loop.backward(_losses(model, x, y))
            model[0].weight.grad = model[0].weight.grad + x.detach().mean()  # a new tensor: not the release's
            opt.step()
    assert "not the one loop.backward released" in _one_line(error)
    assert _equal(_params(model), _params(_model())) and loop.steps == 1


def test_the_trainers_own_step_refuses_a_parameter_it_does_not_privatize():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = make_private(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, seed=7)
    trainer.step()
    added = nn.Parameter(torch.zeros(D))
    opt.add_param_group({"params": [added]})
    (added * X.mean(0)).sum().backward()  # a stale gradient the optimizer would apply
    with pytest.raises(ModelError, match="does not privatize"):
        trainer.step()
    assert torch.equal(added.detach(), torch.zeros(D)) and trainer.steps == 1
    added.requires_grad_(False)
    added.grad = None
    trainer.step()  # frozen: fine
    assert trainer.steps == 2


@pytest.mark.parametrize("api", ["loop", "trainer"])
def test_a_parameter_frozen_after_the_trainer_was_made_is_refused_at_the_step(api):
    """The other half of "every trainable parameter is one the run privatizes": a privatized parameter frozen later
    (requires_grad_(False)) was still moved by every release (its noise), against the freeze, silently."""
    if api == "loop":
        loop, model, opt = _loop(chunk=N)
    else:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        trainer = make_private(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, seed=7)
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    with pytest.raises(DPTrainError) as error:
        if api == "loop":
            for x, y in loop.batches(steps=1):
                loop.backward(_losses(model, x, y))
                opt.step()
        else:
            trainer.step()
    assert "frozen after" in _one_line(error) and "0.weight" in str(error.value)
    assert torch.equal(model[0].weight.detach(), frozen)


def test_a_budget_stops_the_batches():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loop = make_private_loop(
        model, opt, (X, Y), target_epsilon=2.0, target_delta=1e-3, epochs=1, batch_size=64, seed=7,
        max_physical_batch_size=32, accountant="rdp",
    )
    _train(loop, model, opt, steps=20)
    planned = loop.trainer.allowed_steps()
    assert loop.steps == planned == 4  # one epoch at q = 1/4
    assert loop.epsilon().epsilon <= 2.0
    assert _train(loop, model, opt, steps=5) == []


class Records(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": X[i].tolist(), "y": int(Y[i])}


def _collate(items):
    """A user's collate_fn: dict inputs from raw records."""
    return {"features": torch.tensor([r["x"] for r in items]), "labels": torch.tensor([r["y"] for r in items])}


class KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, features):
        return self.net(features)


def test_a_dataloader_with_its_collate_fn_trains_like_the_same_tensors():
    loader = DataLoader(Records(), batch_size=64, shuffle=True, collate_fn=_collate, num_workers=0)
    model = KeywordModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.warns(SamplerReplacedWarning) as caught:
        loop = make_private_loop(model, opt, loader, noise_multiplier=1.0, seed=7, max_physical_batch_size=16)
    assert len([w for w in caught if issubclass(w.category, SamplerReplacedWarning)]) == 1
    assert loop.trainer.sampler.expected_batch_size == 64  # the loader's batch_size
    for inputs, labels in loop.batches(steps=3):
        assert set(inputs) == {"features"}
        loop.backward(F.cross_entropy(model(**inputs), labels, reduction="none"))
        opt.step()
        opt.zero_grad()
    same = KeywordModel()
    same_opt = torch.optim.SGD(same.parameters(), lr=0.5)
    tensors = make_private_loop(
        same, same_opt, ({"features": X}, Y), noise_multiplier=1.0, batch_size=64, seed=7, max_physical_batch_size=16
    )
    for inputs, labels in tensors.batches(steps=3):
        tensors.backward(F.cross_entropy(same(**inputs), labels, reduction="none"))
        same_opt.step()
        same_opt.zero_grad()
    assert loop.ledger.to_dict() == tensors.ledger.to_dict()
    assert _equal(_params(model), _params(same))


def test_a_no_grad_forward_before_backward_is_refused_and_after_it_is_fine():
    def peek(loop, model, opt, x, y):
        with torch.no_grad():
            model(x)

    _misuse(peek, "torch.no_grad")
    loop, model, opt = _loop()
    for x, y in loop.batches(steps=1):
        loop.backward(_losses(model, x, y))
        with torch.no_grad():
            model(x)
        opt.step()
    assert loop.steps == 1


def test_a_loop_made_again_on_the_same_optimizer_ends_the_idle_one_and_its_trainer_trains_only_through_it():
    import dptrain

    first, model, opt = _loop()
    _train(first, model, opt, 1)
    second = dptrain.make_private_loop(
        model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, seed=7, max_physical_batch_size=16
    )
    assert first._closed and not second._closed
    _train(second, model, opt, 1)
    assert second.steps == 1
    with pytest.raises(LoopError) as error:
        second.trainer.train(steps=1)
    assert "belongs to a private loop" in _one_line(error) and second.steps == 1


def test_what_the_loop_cannot_run_is_refused_when_it_is_made():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(ModelError) as error:
        make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, grad_sampler="func", seed=0)
    assert "recomputes the forward pass" in _one_line(error)
    with pytest.raises(ConfigError) as error:
        make_private_loop(model, opt, (X, Y), batch_size=64)
    assert "exactly one of" in _one_line(error)
    with pytest.raises(ConfigError) as error:
        make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, epochs=2)
    _one_line(error)
    with pytest.raises(ConfigError) as error:
        make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, clip=1.0)
    assert "takes no option 'clip'" in _one_line(error)


def test_a_grad_scaler_stepping_the_optimizer_is_refused_and_applies_nothing():
    """torch.amp.GradScaler multiplies the losses by S: the loop would clip at max_grad_norm in scaled units, and after
    unscale_ the clip norm and the noise would be S times smaller than asked. It used to train so, silently (on a
    logical batch of one chunk; on the others torch's own assertion stopped it)."""
    loop, model, opt = _loop(chunk=N)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = _params(model)
    with pytest.raises(LoopError) as error:
        for x, y in loop.batches(steps=1):
            loop.backward(scaler.scale(_losses(model, x, y)))
            scaler.step(opt)
    assert "GradScaler is not for a private loop" in _one_line(error)
    assert _equal(_params(model), before)
