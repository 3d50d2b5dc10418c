"""How we reach nodes, engines and the hub: SSH, docker over SSH, node scripts, HTTP."""
