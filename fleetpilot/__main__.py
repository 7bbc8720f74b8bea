from fleetpilot.cli import main

raise SystemExit(main())
