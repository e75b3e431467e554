"""`make demo`'s commands stay valid main.py commands (flags, files, regexes), without running a
model."""

from pathlib import Path

import pytest

import main
from demo.__main__ import DEMOS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("title, argv", DEMOS, ids=[title.split(":")[0] for title, _ in DEMOS])
def test_demo_commands_parse_and_validate(title, argv):
    args = main.build_parser().parse_args(argv)
    main.validate(args)
    if args.prompt_file is not None:
        assert (ROOT / args.prompt_file).is_file()
