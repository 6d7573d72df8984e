"""``dptrain utility-graph``: the accuracy of w* + N(0, C^2 sigma^2 I) over a (C, sigma) grid, where w* is trained
with clipping and without noise (van Dijk et al., "Proactive DP", Sec. 3.3). NOT private: it trains on the data
without noise; use public or held-out data."""

from __future__ import annotations

import argparse
import json

from dptrain.cli import common
from dptrain.cli.common import check, finite_float, float_list, positive_int

NAME = "utility-graph"
HELP = (
    "accuracy of w* + N(0, C^2 sigma^2 I) over a (C, sigma) grid "
    "(Proactive DP, Sec. 3.3; trains without noise: NOT private)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_config(
        parser,
        required=True,
        help="TOML config: data, model, training (steps/epochs, lr, batch)",
        overrides=False,
    )
    parser.add_argument("--clips", type=float_list, required=True, metavar="C1,C2,...")
    parser.add_argument("--sigmas", type=float_list, required=True, metavar="S1,S2,...")
    parser.add_argument("--draws", type=positive_int, default=5, help="noise draws per (C, sigma)")
    parser.add_argument(
        "--threshold", type=finite_float, default=0.9, help="accuracy fraction to keep (paper: 0.9)"
    )
    parser.add_argument("--out", default=None, help="output directory (default runs/utility-graph)")
    common.add_json(parser)


def run(args: argparse.Namespace) -> int:
    # torch is imported here, not at the top: building the parser must stay light.
    from pathlib import Path

    from dptrain.accounting import RunNumbers
    from dptrain.config import load_config
    from dptrain.data.loaders import load_dataset
    from dptrain.models.builders import build_model
    from dptrain.proactive.utility_graph import accuracy_evaluator, noise_free_trainer, utility_graph

    check(0 < args.threshold <= 1, "--threshold", "in (0, 1]", args.threshold)
    # The graph trains without noise; the privacy section is not used (any valid sigma satisfies the validator).
    cfg = load_config(args.config, ["privacy.noise_multiplier=1.0"], unset=("privacy.target_epsilon",))
    data = load_dataset(cfg.data.name, cfg.data.path, seed=cfg.data.seed, **cfg.data.options)
    t = cfg.training
    # w* is trained on Poisson batches of expected size batch_size (whatever privacy.sampling says).
    steps = RunNumbers.planned(
        "poisson", dataset_size=len(data.train), batch_size=t.batch_size, **cfg.steps_or_epochs
    ).steps
    train = noise_free_trainer(
        lambda: build_model(
            cfg.model.name, data.train.input_shape, data.train.num_classes, **cfg.model.options
        ),
        data,
        steps,
        t.batch_size,
        t.learning_rate,
        cfg.data.seed,
    )
    graph = utility_graph(
        train,
        accuracy_evaluator(data.test.x, data.test.y),
        args.clips,
        args.sigmas,
        args.draws,
        cfg.data.seed,
    )
    out = Path(args.out or "runs/utility-graph")
    out.mkdir(parents=True, exist_ok=True)
    png = graph.plot(out / "utility_graph.png", args.threshold)
    choice = {c: graph.largest_sigma(c, args.threshold) for c in graph.clips}
    result = {**graph.to_dict(), "largest_sigma": choice}
    (out / "utility_graph.json").write_text(json.dumps(result, indent=2))
    if args.json:
        common.print_json(result)
    else:
        print(graph.table(args.threshold))
        print(f"plot: {png}  (w* trained on the data without noise: this exploration is NOT private)")
    return 0
