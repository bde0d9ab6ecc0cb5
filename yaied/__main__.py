"""`python -m yaied ...` is the `yaied` command, for machines where the project is importable but
not installed (a GPU box running the checkout with its own torch)."""

from yaied.cli import main

raise SystemExit(main())
