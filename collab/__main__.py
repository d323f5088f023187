from collab.cli import main

raise SystemExit(main())
