from chatapp.cli import main

raise SystemExit(main())
