"""Code that runs ON a node: standard library only, shipped over SSH by remote.node_script."""
