"""The engine stand-in: a stdlib-only program that behaves like `vllm serve` to the pipeline.

Its modules are also copied flat into the lab's engine image (/opt/standin), so each imports its
siblings as `lab.engine.X` first and as a top-level `X` second.
"""
