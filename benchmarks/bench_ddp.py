"""DDP training step time, unfused against fused, on every rank of a torchrun launch.

    torchrun --nproc-per-node 2 benchmarks/bench_ddp.py                      # CPU: gloo
    torchrun --nproc-per-node 8 benchmarks/bench_ddp.py --model llama-small  # GPUs: nccl / mccl

Two copies of the same model (same seed) train side by side under
``DistributedDataParallel``: the plain one and one fused by ``te_lab.fuse`` before
wrapping, each with its own AdamW. A step is forward, backward (with DDP's gradient
all-reduce) and the optimizer step, timed with the device's timer; the contenders
alternate (A B, B A, ...) after warm-up. A step ends when the slowest rank ends it, so
each step's time is the maximum over ranks. Rank 0 prints the medians, the ratio of the
medians and the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import te_lab
from te_lab import device as devices


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny", help="a te_lab.models.build_model name")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per contender")
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per contender")
    parser.add_argument("--device", default=None, help="device type (musa, cuda, cpu); default: te_lab's default")
    parser.add_argument("--json", default=None, help="also write the figures to this file (rank 0)")
    parser.add_argument("--timeout-s", type=float, default=300,
                        help="a collective waiting longer than this fails (a rank died) instead of hanging")
    return parser.parse_args()


class _Contender:
    def __init__(self, name: str, model, batch: dict):
        self.name, self.model, self.batch = name, DistributedDataParallel(model), batch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.step_ms: list[float] = []

    def step(self, device: torch.device) -> float:
        devices.synchronize(device)
        with devices.Timer(device) as timer:
            self.model(**self.batch).loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
        slowest = torch.tensor([timer.elapsed_ms], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()


def main() -> None:
    arguments = _arguments()
    device = te_lab.distributed.init_process_group(arguments.device,
                                                   timeout=datetime.timedelta(seconds=arguments.timeout_s))
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        plain = te_lab.models.build_model(arguments.model, device=device)
        fused = te_lab.models.build_model(arguments.model, device=device)
        batch = plain.example_batch(batch=arguments.batch, seq=arguments.seq, seed=rank)
        report = te_lab.fuse(fused, sample=batch, progress=False)
        contenders = [_Contender("unfused", plain, batch), _Contender("fused", fused, batch)]
        for contender in contenders:
            for _ in range(arguments.warmup):
                contender.step(device)
        for index in range(arguments.rounds):
            for contender in (contenders if index % 2 == 0 else contenders[::-1]):
                contender.step_ms.append(contender.step(device))
        if rank == 0:
            _print(arguments, device, world_size, report, contenders)
    finally:
        dist.destroy_process_group()


def _print(arguments, device: torch.device, world_size: int, report, contenders) -> None:
    unfused, fused = (c.step_ms for c in contenders)
    figures = dict(
        model=arguments.model, device=devices.device_name(device), backend=devices.distributed_backend(device),
        world_size=world_size, batch_per_rank=arguments.batch, seq=arguments.seq, rounds=arguments.rounds,
        threads_per_rank=torch.get_num_threads(),
        fused_modules=sum(row.status == "fused" for row in report.rows),
        unfused_median_ms=statistics.median(unfused), fused_median_ms=statistics.median(fused),
        speedup_of_medians=statistics.median(unfused) / statistics.median(fused),
        median_pair_speedup=statistics.median(u / f for u, f in zip(unfused, fused)))
    print(f"DDP step, {figures['model']} on {world_size} x {figures['device']} ({figures['backend']}, "
          f"{figures['threads_per_rank']} threads per rank), batch {arguments.batch} x {arguments.seq} per rank, "
          f"{arguments.rounds} interleaved steps each, {figures['fused_modules']} modules fused")
    print(f"  unfused median {figures['unfused_median_ms']:.2f} ms, fused median {figures['fused_median_ms']:.2f} ms, "
          f"speedup {figures['speedup_of_medians']:.3f}x (median per pair {figures['median_pair_speedup']:.3f}x)")
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(figures | dict(unfused_step_ms=unfused, fused_step_ms=fused), file, indent=1)


if __name__ == "__main__":
    main()
