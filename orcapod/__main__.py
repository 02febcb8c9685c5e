from orcapod.cli import main

raise SystemExit(main())
