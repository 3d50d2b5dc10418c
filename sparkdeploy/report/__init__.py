"""What the artifacts show people: markdown tables and SVG charts."""
