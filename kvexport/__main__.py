"""`python -m kvexport` runs the CLI."""
from kvexport.cli import main

raise SystemExit(main())
