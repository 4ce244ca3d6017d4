from detinfer.cli import main

raise SystemExit(main())
