"""`exactresume export`: inference weights in fp16/bf16/fp32, as .pt or .safetensors, checked on real logits.

exactresume export runs/a/resume.pth -o model.safetensors
"""

from __future__ import annotations

import argparse

from exactresume.commands.output import add_output_flags, emit
from exactresume.commands.places import DEFAULT_DATA, given_path


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=given_path, help="a resume file or a weights file")
    parser.add_argument("-o", "--out", type=given_path, required=True, help="the file to write")
    parser.add_argument(
        "--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="dtype of the exported weights"
    )
    parser.add_argument("--format", choices=("pt", "safetensors"), help="container (default: from OUT's suffix)")
    parser.add_argument("--clamp", action="store_true", help="saturate values beyond fp16's ±65504 instead of refusing")
    parser.add_argument("--data", type=given_path, default=DEFAULT_DATA, help="folder with val.npy for the logit check")
    parser.add_argument("--overwrite", action="store_true", help="replace a file already at OUT (never a folder)")
    add_output_flags(parser, progress=False)


def run(args: argparse.Namespace) -> int:
    from exactresume.training.inference import ExportConfig, describe_export, export_weights, format_for

    config = ExportConfig(
        args.source,
        args.out,
        dtype=args.dtype,
        format=args.format or format_for(args.out),
        clamp=args.clamp,
        data=args.data,
        overwrite=args.overwrite,
    )
    result = export_weights(config)
    summary = {"command": "export", "source": str(config.source), "out": str(config.out), "dtype": config.dtype}
    summary |= {"format": config.format} | result
    emit(args, summary, lambda s: describe_export(config, result), gap=False)
    return 0
