"""The engine's parallel layout as vLLM's multi-node mp executor has it: TP x PP ranks spread
evenly over the nodes, the checks vLLM makes of it, and the lines each rank's worker process
prints as the process group forms."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

try:
    from lab.engine.standin_log import EngineFatal, Logger
except ImportError:  # copied flat into the engine image
    from standin_log import EngineFatal, Logger  # type: ignore[no-redef, import-not-found]


@dataclass(frozen=True)
class ParallelLayout:
    nnodes: int
    node_rank: int
    tp: int
    pp: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelLayout:
        return cls(
            nnodes=args.nnodes or 1,
            node_rank=args.node_rank or 0,
            tp=args.tensor_parallel_size or 1,
            pp=args.pipeline_parallel_size or 1,
        )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.nnodes

    def local_ranks(self) -> list[int]:
        """This node's ranks."""
        first = self.node_rank * self.gpus_per_node
        return list(range(first, first + self.gpus_per_node))

    def check(self, backend: str | None, headless: bool) -> None:
        """vLLM's refusals of a layout it cannot run (EngineFatal, before the engine core)."""
        if self.nnodes > 1 and backend == "ray":
            raise EngineFatal(
                [
                    f"ValueError: nnodes={self.nnodes} (multi-node without Ray) needs "
                    "distributed_executor_backend='mp', got 'ray'; with Ray, start the Ray "
                    "cluster and run one `vllm serve` on the head without --nnodes"
                ],
                engine_core=False,
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise EngineFatal(
                [f"ValueError: node_rank {self.node_rank} is not in [0, nnodes={self.nnodes})"],
                engine_core=False,
            )
        if self.world_size % self.nnodes:
            raise EngineFatal(
                [
                    f"ValueError: world size {self.world_size} (tensor_parallel_size {self.tp}"
                    f" x pipeline_parallel_size {self.pp}) is not divisible by nnodes "
                    f"{self.nnodes}"
                ],
                engine_core=False,
            )
        if headless and self.node_rank == 0:
            raise EngineFatal(
                ["ValueError: --headless is for the worker nodes (node rank > 0)"],
                engine_core=False,
            )

    def worker_log(self, rank: int) -> Logger:
        """The worker process of `rank` once its rank is assigned."""
        return Logger(f"Worker_TP{rank}" if self.world_size > 1 else "Worker")

    def print_process_group(self, log: Logger, rank: int, addr: str, port: int) -> None:
        log.info(
            "parallel_state.py:1906",
            f"world_size={self.world_size} rank={rank} local_rank={rank % self.gpus_per_node} "
            f"distributed_init_method=tcp://{addr}:{port} backend=nccl",
        )

    def print_rank_assignments(self, log: Logger) -> None:
        """vLLM's line once the process group has formed: this rank has joined."""
        for rank in self.local_ranks():
            log.info(
                "parallel_state.py:2350",
                f"rank {rank} in world size {self.world_size} is assigned as DP rank 0, PP rank "
                f"{rank // self.tp}, PCP rank 0, TP rank {rank % self.tp}, ETP rank "
                f"{rank % self.tp}, EP rank N/A, EPLB rank N/A",
            )
