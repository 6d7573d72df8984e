"""Tests for dptrain.models.builders: architectures, shapes, parameter counts and batch-mixing checks."""

import pytest
import torch
from torch import nn

from dptrain.errors import ModelError
from dptrain.models.builders import (
    BATCH_MIXING_TYPES,
    MODEL_NAMES,
    build_model,
    check_private_compatible,
    convert_batchnorm_to_groupnorm,
    count_parameters,
    find_batch_mixing_layers,
)

# The input shape each model is meant for.
#: The built-in models ("hf" needs options and dict inputs: tests/test_hf_cli.py)
BUILTIN = [n for n in MODEL_NAMES if n != "hf"]

SHAPES = {
    "logistic": (1, 28, 28),
    "mlp": (1, 28, 28),
    "cnn28": (1, 28, 28),
    "cnn32": (3, 32, 32),
    "resnet20": (3, 32, 32),
    "tiny_transformer": (16,),
    "scatternet_linear": (81, 7, 7),
    "scatternet_cnn": (81, 7, 7),
}


def example_inputs(name: str, n: int) -> torch.Tensor:
    """A batch of inputs for model ``name``: token ids for the transformer, standard normals otherwise."""
    if name == "tiny_transformer":
        return torch.randint(0, 32, (n, *SHAPES[name]))
    return torch.randn(n, *SHAPES[name])


def assert_per_example(model: nn.Module, x: torch.Tensor) -> None:
    """model(x)[i] equals model(x[i:i+1]) for each i, in train and eval mode (float64, so exact enough)."""
    model = model.double()
    x = x.double() if x.dtype.is_floating_point else x
    for training in (True, False):
        model.train(training)
        with torch.no_grad():
            batched = model(x)
            for i in range(len(x)):
                torch.testing.assert_close(batched[i : i + 1], model(x[i : i + 1]), rtol=1e-9, atol=1e-10)


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(8, 6, 3), nn.BatchNorm2d(6)),
        nn.Flatten(),
        nn.Linear(6 * 6 * 6, 12),
        nn.BatchNorm1d(12),
        nn.Linear(12, 4),
    )
    with torch.no_grad():  # non-trivial affine parameters, to check they are copied
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 2.0)
                m.bias.uniform_(-1.0, 1.0)
    return model


def test_model_names_are_all_buildable():
    assert set(BUILTIN) == set(SHAPES) and set(MODEL_NAMES) == {*BUILTIN, "hf"}


@pytest.mark.parametrize("name", BUILTIN)
def test_output_shape(name):
    torch.manual_seed(0)
    model = build_model(name, SHAPES[name], 10)
    out = model(example_inputs(name, 5))
    assert out.shape == (5, 10)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", BUILTIN)
def test_no_batch_mixing_layers(name):
    model = build_model(name, SHAPES[name], 10)
    assert find_batch_mixing_layers(model) == []
    check_private_compatible(model)
    allowed = (
        nn.Sequential, nn.Linear, nn.Conv2d, nn.GroupNorm, nn.Tanh, nn.ReLU, nn.MaxPool2d,
        nn.AdaptiveAvgPool2d, nn.Flatten, nn.Embedding, nn.LayerNorm,
    )  # fmt: skip
    # ResNet20 and its blocks are containers of the allowed layers.
    leaves = [m for m in model.modules() if not list(m.children())]
    assert all(isinstance(m, allowed) for m in leaves), [type(m) for m in leaves]


@pytest.mark.parametrize("name", BUILTIN)
def test_output_of_one_example_ignores_the_rest_of_the_batch(name):
    torch.manual_seed(1)
    assert_per_example(build_model(name, SHAPES[name], 10), example_inputs(name, 4))


def test_cnn28_parameter_count_by_hand():
    conv1 = 16 * 1 * 8 * 8 + 16  # 1040
    conv2 = 32 * 16 * 4 * 4 + 32  # 8224
    fc1 = 32 * 4 * 4 * 32 + 32  # 16416
    fc2 = 32 * 10 + 10  # 330
    assert count_parameters(build_model("cnn28", (1, 28, 28), 10)) == conv1 + conv2 + fc1 + fc2 == 26010


def test_cnn32_parameter_count_by_hand():
    weights = (3 * 32 + 32 * 32 + 32 * 64 + 64 * 64 + 64 * 128 + 128 * 128) * 3 * 3
    convs = weights + (32 + 32 + 64 + 64 + 128 + 128)
    fcs = 128 * 4 * 4 * 128 + 128 + 128 * 10 + 10
    assert count_parameters(build_model("cnn32", (3, 32, 32), 10)) == convs + fcs == 550570


def test_logistic_and_mlp_parameter_counts():
    assert count_parameters(build_model("logistic", (1, 28, 28), 10)) == 784 * 10 + 10
    mlp = build_model("mlp", (20,), 3, hidden=[16, 8], activation="relu")
    assert count_parameters(mlp) == (20 * 16 + 16) + (16 * 8 + 8) + (8 * 3 + 3)
    assert sum(isinstance(m, nn.ReLU) for m in mlp.modules()) == 2
    assert not any(isinstance(m, nn.Tanh) for m in mlp.modules())
    default = build_model("mlp", (20,), 3)
    assert [m.out_features for m in default.modules() if isinstance(m, nn.Linear)] == [128, 3]
    assert any(isinstance(m, nn.Tanh) for m in default.modules())
    assert build_model("mlp", (20,), 3, hidden=[])(torch.randn(2, 20)).shape == (2, 3)


def test_cnn28_feature_map_is_32x4x4_before_first_linear():
    model = build_model("cnn28", (1, 28, 28), 10)
    first_linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
    assert first_linear.in_features == 32 * 4 * 4
    seen = []
    flatten = next(m for m in model.modules() if isinstance(m, nn.Flatten))
    flatten.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape))
    model(torch.randn(2, 1, 28, 28))
    assert seen == [torch.Size([2, 32, 4, 4])]


def test_cnn_activation_option():
    relu = build_model("cnn28", (1, 28, 28), 10, activation="relu")
    assert any(isinstance(m, nn.ReLU) for m in relu.modules())
    assert not any(isinstance(m, nn.Tanh) for m in relu.modules())
    tanh = build_model("cnn32", (3, 32, 32), 10)
    assert sum(isinstance(m, nn.Tanh) for m in tanh.modules()) == 7


def test_resnet20_structure_and_parameter_count():
    model = build_model("resnet20", (3, 32, 32), 10)
    n = count_parameters(model)
    assert 260_000 <= n <= 280_000
    # 3x3 stem + 3 stages x 3 blocks x 2 convs = 19 convs, all 3x3 (option-A shortcuts have no conv).
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 19 and all(c.kernel_size == (3, 3) for c in convs)
    assert [c.out_channels for c in convs] == [16] * 7 + [32] * 6 + [64] * 6
    assert sum(c.stride == (2, 2) for c in convs) == 2
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 19 and all(g.num_groups == 16 for g in norms)
    fc = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(fc) == 1 and fc[0].in_features == 64
    # Global average pooling takes other image sizes too.
    assert model(torch.randn(2, 3, 40, 24)).shape == (2, 10)


def test_resnet20_groups_option():
    model = build_model("resnet20", (1, 32, 32), 7, groups=4)
    assert {m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)} == {4}
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 7)
    for bad in (3, 32, 0, "8", True):
        with pytest.raises(ModelError, match="groups"):
            build_model("resnet20", (3, 32, 32), 10, groups=bad)


def test_unknown_model_name():
    with pytest.raises(ModelError, match="unknown model 'vgg16'") as info:
        build_model("vgg16", (3, 32, 32), 10)
    for name in MODEL_NAMES:
        assert name in str(info.value)


def test_unknown_option_names_it_and_the_accepted_ones():
    with pytest.raises(ModelError, match="'width'") as info:
        build_model("mlp", (10,), 2, width=64)
    assert "'hidden'" in str(info.value) and "'activation'" in str(info.value)
    with pytest.raises(ModelError, match="'activation'.*logistic.*none"):
        build_model("logistic", (10,), 2, activation="relu")
    with pytest.raises(ModelError, match="'hidden'.*'activation'"):
        build_model("cnn28", (1, 28, 28), 10, hidden=[10])


@pytest.mark.parametrize(
    ("name", "options", "fragment"),
    [
        ("mlp", {"activation": "sigmoid"}, "activation 'sigmoid'"),
        ("cnn32", {"activation": "gelu"}, "activation 'gelu'"),
        ("mlp", {"hidden": 128}, "hidden"),
        ("mlp", {"hidden": [64, 0]}, "hidden"),
    ],
)
def test_bad_option_values(name, options, fragment):
    with pytest.raises(ModelError, match=fragment):
        build_model(name, SHAPES[name], 10, **options)


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("cnn28", (3, 32, 32), r"\(C, 28, 28\)"),
        ("cnn28", (784,), r"\(C, 28, 28\)"),
        ("cnn32", (1, 28, 28), r"\(C, 32, 32\)"),
        ("resnet20", (3072,), r"\(C, H, W\)"),
        ("logistic", (), "non-empty"),
        ("mlp", (1, 0, 28), "positive"),
    ],
)
def test_bad_input_shape(name, shape, expected):
    with pytest.raises(ModelError, match=expected) as info:
        build_model(name, shape, 10)
    assert "\n" not in str(info.value) and name in str(info.value)


def test_bad_num_classes():
    with pytest.raises(ModelError, match="num_classes"):
        build_model("logistic", (4,), 0)


def test_batchnorm_is_found_and_rejected():
    model = bn_model()
    assert find_batch_mixing_layers(model) == ["1", "3.1", "6"]
    with pytest.raises(ModelError, match="GroupNorm") as info:
        check_private_compatible(model)
    message = str(info.value)
    assert "'1' (BatchNorm2d)" in message and "'6' (BatchNorm1d)" in message and "\n" not in message
    single = nn.Sequential()
    single.add_module("features", nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))
    with pytest.raises(ModelError, match=r"model layer 'features\.1' \(BatchNorm2d\) mixes examples"):
        check_private_compatible(single)


def test_other_batchnorm_variants_are_found():
    model = nn.Sequential(nn.LazyBatchNorm1d(), nn.SyncBatchNorm(4), nn.BatchNorm3d(2), nn.InstanceNorm2d(3))
    assert find_batch_mixing_layers(model) == ["0", "1", "2"]
    assert all(isinstance(model[i], BATCH_MIXING_TYPES) for i in range(3))
    assert find_batch_mixing_layers(nn.BatchNorm1d(3)) == [""]


def test_norms_that_do_not_mix_examples_are_accepted():
    check_private_compatible(nn.Sequential(nn.InstanceNorm2d(3), nn.LayerNorm(5), nn.GroupNorm(1, 3)))
    # InstanceNorm does not mix examples, but running statistics would leak un-noised data statistics.
    with pytest.raises(ModelError, match="running statistics"):
        check_private_compatible(nn.Sequential(nn.InstanceNorm2d(3, track_running_stats=True)))


def test_the_independence_check_detects_batchnorm():
    model = bn_model()[:4]  # up to the BatchNorm2d layers (BatchNorm1d refuses a batch of one in training)
    with pytest.raises(AssertionError):
        assert_per_example(model, torch.randn(4, 3, 8, 8))


def test_convert_batchnorm_to_groupnorm():
    model = bn_model()
    x = torch.randn(4, 3, 8, 8)
    shape_before = model(x).shape
    old = [(m.num_features, m.weight.detach().clone(), m.bias.detach().clone()) for m in model.modules()
           if isinstance(m, nn.modules.batchnorm._BatchNorm)]  # fmt: skip

    converted = convert_batchnorm_to_groupnorm(model, num_groups=4)

    assert converted is model
    assert find_batch_mixing_layers(model) == []
    check_private_compatible(model)
    norms = [model[1], model[3][1], model[6]]
    assert all(isinstance(g, nn.GroupNorm) for g in norms)
    # gcd(4, 8) = 4, gcd(4, 6) = 2, gcd(4, 12) = 4.
    assert [g.num_groups for g in norms] == [4, 2, 4]
    for g, (channels, weight, bias) in zip(norms, old, strict=True):
        assert g.num_channels == channels
        torch.testing.assert_close(g.weight.detach(), weight, rtol=0, atol=0)
        torch.testing.assert_close(g.bias.detach(), bias, rtol=0, atol=0)
    assert model(x).shape == shape_before
    assert_per_example(model, x)


def test_convert_default_groups_non_affine_and_root():
    model = nn.Sequential(nn.Conv2d(1, 48, 1), nn.BatchNorm2d(48, affine=False))
    convert_batchnorm_to_groupnorm(model)
    assert model[1].num_groups == 16 and not model[1].affine  # gcd(32, 48)
    root = convert_batchnorm_to_groupnorm(nn.BatchNorm1d(10), num_groups=3)
    assert isinstance(root, nn.GroupNorm) and root.num_groups == 1
    assert root(torch.randn(5, 10)).shape == (5, 10)
    shared = nn.BatchNorm1d(6)
    twice = convert_batchnorm_to_groupnorm(nn.Sequential(nn.Linear(6, 6), shared, nn.Linear(6, 6), shared))
    assert twice[1] is twice[3] and isinstance(twice[1], nn.GroupNorm)
    with pytest.raises(ModelError, match="num_groups"):
        convert_batchnorm_to_groupnorm(nn.BatchNorm1d(4), num_groups=0)
    with pytest.raises(ModelError, match="forward pass"):
        convert_batchnorm_to_groupnorm(nn.Sequential(nn.LazyBatchNorm1d()))


def test_count_parameters():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    assert count_parameters(model) == 3 * 4 + 4 + 4 * 2 + 2
    model[0].requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 4 * 2 + 2
    shared = nn.Linear(2, 2)
    assert count_parameters(nn.Sequential(shared, shared)) == 6
