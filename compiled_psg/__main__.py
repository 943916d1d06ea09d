"""``python -m compiled_psg`` / ``compiled-psg``: subcommands ``train``, ``finetune``, ``explain`` and ``graphs``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="compiled-psg", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,finetune,explain,graphs}")
    commands.add_parser("train", add_help=False, help="train a small CNN on digits with DP-SGD (the first main job)")
    commands.add_parser("finetune", add_help=False,
                        help="DP LoRA fine-tuning of a tiny Llama-style model on stdlib docstrings (the second "
                             "main job; needs .[hf])")
    commands.add_parser("explain", add_help=False, help="explain how a bundled example model is rewritten")
    commands.add_parser("graphs", add_help=False, help="regenerate the reference dumps in graphs/")
    known = parser.parse_args(argv[:1])
    rest = argv[1:]
    if known.command == "train":
        from ._jobs.train import main as train_main

        return train_main(rest)
    if known.command == "finetune":
        from ._jobs.finetune import main as finetune_main

        return finetune_main(rest)
    if known.command == "graphs":
        from ._jobs.explain import graphs_main

        return graphs_main(rest)
    from ._jobs.explain import main as explain_main

    return explain_main(rest)


if __name__ == "__main__":
    sys.exit(main())
