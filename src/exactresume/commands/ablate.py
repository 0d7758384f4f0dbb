"""`exactresume ablate`: resume with each part of the resume file lost in turn, measured; or its table.

exactresume ablate --out runs/ablate
exactresume ablate --markdown docs/ablation.json --readme docs/resume-file.md
"""

from __future__ import annotations

import argparse
import json

from exactresume import summaries
from exactresume.commands.config_flags import (
    ABLATION_GROUP,
    FEATURES_GROUP,
    OUTPUTS_GROUP,
    RUN_GROUP,
    add_config_flags,
    add_groups,
    config_from_args,
)
from exactresume.commands.output import add_output_flags, emit
from exactresume.commands.places import add_data_flag, given_path
from exactresume.commands.writer import add_writer_flags, lock_out
from exactresume.errors import UserError


def add_flags(parser: argparse.ArgumentParser) -> None:
    groups = add_groups(parser, names=(RUN_GROUP, FEATURES_GROUP, ABLATION_GROUP, OUTPUTS_GROUP))
    add_data_flag(groups[RUN_GROUP])
    add_config_flags(groups)
    groups[RUN_GROUP].add_argument("--stop-at", type=int, default=30, help="where every ablated run resumes")
    ablation = groups[ABLATION_GROUP]
    ablation.add_argument(
        "--ablation-dropout", type=float, default=0.1, help="dropout of the setup that measures the rng part"
    )
    ablation.add_argument(
        "--markdown", type=given_path, metavar="JSON", help="train nothing: print the table of this ablation.json"
    )
    ablation.add_argument(
        "--readme", type=given_path, help="with --markdown: write the table between the ablation markers of this file"
    )
    groups[OUTPUTS_GROUP].add_argument("--out", type=given_path, help="output folder")
    add_output_flags(groups[OUTPUTS_GROUP], progress=False)
    add_writer_flags(groups[OUTPUTS_GROUP])


def run(args: argparse.Namespace) -> int:
    if args.markdown is not None:
        return render_table(args)
    from exactresume.lab.ablate import AblationConfig, run_ablation

    if args.out is None or args.readme is not None:
        raise UserError("give --out DIR to run the ablation, or --markdown ablation.json [--readme FILE] to render one")
    config = AblationConfig(
        train=config_from_args(args),
        stop_at=args.stop_at,
        data=args.data,
        out=args.out,
        dropout=args.ablation_dropout,
    )
    lock = lock_out("ablate", config.out, args.wait_lock)
    run_ablation(config)
    lock.release()
    emit(args, summaries.ablate_summary(config.out), summaries.render_ablate)
    return 0


def render_table(args: argparse.Namespace) -> int:
    """--markdown: the table of an ablation.json, printed or written into --readme's block."""
    from exactresume.lab.ablate import ABLATION_VERSION
    from exactresume.report.tables import render_markdown, write_readme_block

    try:
        ablation = json.loads(args.markdown.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read the ablation {args.markdown}: {error}") from None
    if not isinstance(ablation, dict) or ablation.get("version") != ABLATION_VERSION:
        raise UserError(f"{args.markdown} is not an ablation.json of version {ABLATION_VERSION}")
    if args.readme is None:
        print(render_markdown(ablation))
        return 0
    write_readme_block(args.readme, ablation)
    emit(args, {"command": "ablate", "readme": str(args.readme)}, lambda s: [f"wrote the table into {s['readme']}"])
    return 0
