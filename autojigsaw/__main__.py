"""`python -m autojigsaw plan ...`: the command line (autojigsaw/cli)."""

from .cli import main

raise SystemExit(main())
